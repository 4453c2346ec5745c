"""Decode steps replayed as CUDA graphs: a step of only decode rows costs one launch instead of hundreds.

At start the runner captures one graph per batch size bucket (BUCKETS up to the step's token budget), each a
forward pass of `size` decode rows over static tensors: ids, positions, slots, block tables, context lengths,
the sampled rows, and the Triton backend's split workspace, sized for rows of up to GRAPH_MAX_KEYS keys (or the
model's longest context, if shorter). A step of n decode rows (n at most the largest bucket, none longer) runs
the smallest bucket >= n: its tensors are filled (the padding rows write no K/V, slot -1, and read no keys,
length 0), the graph replayed, a copy of the first n rows of its logits returned. Steps with a prefill chunk
run eagerly, as before.

Everything but the capture itself is plain tensor work: `StaticDecode` runs eagerly on a CPU (the Triton
kernels in triton's interpreter) so its filling and padding are tested there against the eager path; on
CUDA `DecodeGraphs.capture` records each bucket's forward into a graph after one eager warm-up (Triton
compiles its kernels on first use, which a capture must not do). What the capture asks of CUDA (a side stream,
a graph recorded, a synchronize) is a `GraphRecorder`: the capture's order and its stops between buckets (a
start-up asked to stop, server/startup.py) are tested on a CPU with a stand-in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from server.engine.scheduler import Row
from server.kv.attention import DecodeRows, StepMeta, stepping
from server.kv.backends import TritonBackend, TritonLaunch
from server.startup import Startup

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode rows a captured step holds
# Keys a captured step's rows may have (longer rows run eagerly): the split workspace and the tables are sized for
# it, per bucket (64 rows of 32 heads of 128 dims: 64 splits of 256 keys, 64 MB), whatever the model's context.
GRAPH_MAX_KEYS = 16384


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """The bucket sizes a runner whose steps hold at most `max_rows` tokens captures."""
    return tuple(b for b in BUCKETS if b <= max_rows) or (1,)


def bucket_of(num_rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding this many rows (None: more rows than the largest)."""
    return next((b for b in sizes if b >= num_rows), None)


@dataclass(slots=True)
class GraphStats:
    num_replays: int = 0  # decode steps served by a graph (or, on a CPU, by the static step)
    num_eager: int = 0  # decode-only steps that did not fit one (more rows, or a longer table)
    capture_s: float = 0.0


class StaticDecode:
    """One bucket's step over static tensors (see the module's docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: TritonBackend,
        size: int,
        max_blocks: int,
        max_keys: int,
        num_heads: int,
        head_dim: int,
        device: torch.device,
    ) -> None:
        self.model, self.size, self.max_blocks, self.max_keys = model, size, max_blocks, max_keys
        long, int32 = torch.long, torch.int32
        self.input_ids = torch.zeros((1, size), dtype=long, device=device)
        self.position_ids = torch.zeros((1, size), dtype=long, device=device)
        self.slots = torch.full((size,), -1, dtype=long, device=device)
        self.tables = torch.zeros((size, max_blocks), dtype=int32, device=device)
        self.lens = torch.zeros((size,), dtype=int32, device=device)
        self.sampled_at = torch.arange(size, dtype=long, device=device)
        self.no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)  # steps read no mask
        rows = torch.arange(size, dtype=int32, device=device)
        workspace = backend.kernels.decode_workspace(size, num_heads, head_dim, max_keys, device)
        decode = DecodeRows(rows, self.tables, self.lens)
        self.meta = StepMeta(backend.pool, self.slots, [], decode=decode, backend=backend)
        self.meta.launch = TritonLaunch(max_keys=max_keys, workspace=workspace)
        self.logits: torch.Tensor | None = None

    def fits(self, rows: list[Row]) -> bool:
        return len(rows) <= self.size and all(
            len(r.seq.blocks) <= self.max_blocks and r.seq.num_computed < self.max_keys for r in rows
        )

    def load(self, rows: list[Row], slot_ids: Callable[[list[int], int, int], list[int]]) -> None:
        """These decode rows into the static tensors; the rest are padding (no K/V written, no keys read)."""
        n, pad = len(rows), self.size - len(rows)
        ids, positions, slots, lens, tables = [], [], [], [], []
        for row in rows:
            position = row.seq.num_computed
            table = [b.block_id for b in row.seq.blocks]
            ids.append(row.token_ids[0])
            positions.append(position)
            slots += slot_ids(table, position, position + 1)
            lens.append(position + 1)
            tables.append(table + [0] * (self.max_blocks - len(table)))
        self.input_ids.copy_(torch.tensor([ids + [0] * pad]), non_blocking=True)
        self.position_ids.copy_(torch.tensor([positions + [0] * pad]), non_blocking=True)
        self.slots.copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.lens.copy_(torch.tensor(lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        # the padding rows' tables keep what earlier steps left there: with no keys they read none of it
        self.tables[:n].copy_(torch.tensor(tables, dtype=torch.int32).view(n, self.max_blocks), non_blocking=True)

    def forward(self) -> None:
        """The step over the static tensors; its logits [size, V] land in `self.logits` (the same tensor on every
        replay of a captured graph)."""
        with torch.inference_mode(), stepping(self.meta):
            out = self.model(
                input_ids=self.input_ids,
                position_ids=self.position_ids,
                attention_mask=self.no_mask,
                use_cache=False,
                logits_to_keep=self.sampled_at,
            )
        self.logits = out.logits[0]


class GraphRecorder(Protocol):
    """What a capture needs of the device."""

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        """Work inside runs on a side stream (warm-ups: a capture may not follow them on the default stream)."""
        ...

    def record(self, forward: Callable[[], None]) -> Any:
        """`forward` recorded into a graph (into the one memory pool every graph of this capture shares)."""
        ...

    def synchronize(self) -> None: ...


class CudaGraphRecorder:
    """CUDA's: on the model's device, whichever device the loading thread is on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: Any = None

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                yield
            torch.cuda.current_stream().wait_stream(side)

    def record(self, forward: Callable[[], None]) -> torch.cuda.CUDAGraph:
        with torch.cuda.device(self.device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # other engines may load
                forward()
            return graph

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class DecodeGraphs:
    """The runner's captured decode steps: `run` serves a step of decode rows from the bucket that holds it."""

    def __init__(self, statics: list[StaticDecode], slot_ids: Callable[[list[int], int, int], list[int]]) -> None:
        self.statics = sorted(statics, key=lambda s: s.size)
        self.sizes = tuple(s.size for s in self.statics)
        self.slot_ids = slot_ids
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stats = GraphStats()

    def capture(self, recorder: GraphRecorder, startup: Startup | None = None) -> None:
        """Each bucket's forward recorded into a graph (largest first, all in one memory pool), after a warm-up
        that compiles the kernels. The padding-only warm-up writes nothing to the pool. `startup` is asked between
        buckets, never during one's capture, whether to stop (StartupStopped)."""
        startup = startup or Startup()
        start = time.perf_counter()
        largest_first = list(reversed(self.statics))
        with recorder.side_stream():
            for static in largest_first:
                startup.check()
                static.forward()  # the warm-up: Triton compiles here, never under capture
        for static in largest_first:
            startup.check()
            self.graphs[static.size] = recorder.record(static.forward)
        recorder.synchronize()
        self.stats.capture_s = time.perf_counter() - start

    def run(self, rows: list[Row]) -> torch.Tensor | None:
        """Logits [n, V] of a step of n decode rows, from its bucket; None when the step is not one (a prefill
        chunk, more rows than the largest bucket, a table longer than the graphs'): it runs eagerly."""
        if not all(len(r.token_ids) == 1 and r.is_sampled and r.seq.num_computed > 0 for r in rows):
            return None
        size = bucket_of(len(rows), self.sizes)
        static = None if size is None else self.statics[self.sizes.index(size)]
        if static is None or not static.fits(rows):
            self.stats.num_eager += 1
            return None
        static.load(rows, self.slot_ids)
        graph = self.graphs.get(static.size)
        if graph is not None:
            graph.replay()
        else:  # not captured (a CPU): the same step, eagerly
            static.forward()
        self.stats.num_replays += 1
        assert static.logits is not None
        return static.logits[: len(rows)].clone()  # the next replay writes over the graph's own
