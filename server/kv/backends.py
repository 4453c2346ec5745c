"""Attention backends: how a step's rows attend over the paged pool, chosen once per model.

A backend answers two questions for the model runner: what a step's attention metadata is (`plan`: the
rows of a packed step -> a `StepMeta`) and how one layer runs it (`attend`). Which backend serves a
model is decided once, at load, by one pure function of what the machine and the model offer
(`choose_backend`); the runner never branches on flags afterwards. A new device (the GPU's Triton
kernels) is one more class and one more line in `choose_backend`.

- `TiledBackend`: a bf16 pool on a CPU with AVX512-BF16, head size 64 or 128, layers without window or
  softcap, K/V not quantized. Every row walks its keys through one arithmetic (server/kv/csrc/
  paged_prefill.cpp: 16-key tiles, a softmax step every 64 keys, partitions of 256 keys merged in order,
  from key 0): prefill chunks in one call of `paged_prefill`, decode rows in one call of
  `paged_decode_rows` (a long row's partitions on several threads), and decode rows sharing a long prefix
  (a cached system prompt) resume from one walk over that prefix for all of them (a cascade head, kept
  laid out across steps) at a partition's edge. So a token's attention is bit for bit the same whichever
  way it was computed, and deterministic mode costs this backend's attention nothing (its price is in
  the linear products: server/models/packed_linear.py, `decode_products`). Prefill chunks may go to SDPA
  instead where it was timed faster at start (not in deterministic mode).
- `KernelBackend`: the C++ decode kernel on any CPU pool it serves (fp32, fp16, bf16 without the tiled
  kernel's conditions, 8-bit K/V, windows, softcaps): short decode rows in one call; long ones by cascade
  heads (torch's flash attention, resumed by the kernel), SDPA on a view or the kernel, as timed at start;
  prefill chunks by SDPA (or the prefill kernel over a dequantized copy, for 8-bit pools). In deterministic
  mode every token of every row is a kernel row (one order per position, no choice).
- `TritonBackend`: the Triton kernels (server/kv/triton_attention.py) on a CUDA device where triton is
  installed: the K/V write (quantizing for 8-bit pools), decode rows by a split-K kernel (fixed splits of
  SPLIT_KEYS keys, merged in order), prefill chunks by a kernel walking the chunk's earlier K/V in place;
  windows, softcaps and 8-bit K/V in the kernels. In deterministic mode every token is a decode row over its
  own keys (one order per position, as the kernel backend does). On a CPU they run under TRITON_INTERPRET=1
  only (the tests).
- `SdpaBackend`: every row one SDPA call over its context (no compiler on the machine, or neither a CPU nor a
  CUDA device with triton).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from server.kv.attention import DecodeRows, PrefillRows, SeqSpan, SharedHead, StepMeta, attend_spans, flash_heads
from server.kv.blocks import Block
from server.kv.head_layouts import HeadLayouts
from server.kv.pool import KVPool
from server.kv.routing import KERNEL, SDPA

log = logging.getLogger("kvserve.engine")

SDPA_BACKEND, KERNEL_BACKEND, TILED_BACKEND, TRITON_BACKEND = "sdpa", "kernel", "tiled", "triton"
BACKENDS = (SDPA_BACKEND, KERNEL_BACKEND, TILED_BACKEND, TRITON_BACKEND)
# Decode rows with at most this many keys go to the decode kernel, all in one call: it saves SDPA's per-call cost,
# which is most of a short row's time (bench/probes/attention_cost.py). A longer row shares a head with the rows whose
# blocks start alike (cascade attention); a lone one goes the way timed fastest on this machine at start
# (server/kv/routing.py). SDPA never reads gathered slots for a decode row (the kernel is cheaper).
KERNEL_MAX_CONTEXT = 256
# The tiled walk's partition: a row's keys are walked a partition at a time and the partitions merged in order
# (paged_prefill.cpp: kPart). A cascade head ends on one, so the rows' tails resume exactly where a walk over the
# whole context would be.
WALK_PARTITION = 256
# Rows share a head in the tiled backend when their common prefix holds at least this many keys: below it one
# walk per row over a short prefix costs about what the head's separate call saves.
TILED_HEAD_MIN_KEYS = 256
_EMPTY = torch.empty(0)


@dataclass(frozen=True, slots=True)
class BackendFacts:
    """What decides the backend: the machine, the pool and the model's layers, and the mode asked for."""

    device: str  # torch device type
    has_kernels: bool  # our C++ kernels built and loaded here
    tiled_serves: bool  # the tiled kernel serves this pool's dtype and head size on this CPU (AVX512-BF16)
    is_quantized: bool  # K/V stored in 8 bits
    plain_layers: bool  # no layer has a sliding window or a logit softcap
    deterministic: bool  # deterministic mode asked for (and the linear layers can be made batch-invariant)
    has_triton: bool = False  # triton is installed (the GPU kernels)


def choose_backend(facts: BackendFacts) -> str:
    """The backend for these facts: the Triton kernels on a CUDA device that has triton; on a CPU the tiled kernel
    wherever it serves, else the decode kernel where it was built; else SDPA."""
    if facts.device == "cuda" and facts.has_triton:
        return TRITON_BACKEND
    if facts.device != "cpu" or not facts.has_kernels:
        return SDPA_BACKEND
    if facts.tiled_serves and not facts.is_quantized and facts.plain_layers:
        return TILED_BACKEND
    return KERNEL_BACKEND


@dataclass(slots=True)
class StepRow:
    """One sequence's part of a packed step: where its tokens sit and where its keys are."""

    at: int  # its first token's index in the packed row
    num_tokens: int
    ctx_len: int  # keys once this step's tokens are written: its last token's position + 1
    table: list[int]  # its block ids, in order
    blocks: list[Block]  # the same blocks (their stamps key kept head layouts)


@dataclass(slots=True)
class DecodeRow:
    """A single-token row bound for a kernel: where it sits, its blocks, its keys and its head (0: none)."""

    at: int
    table: list[int]
    ctx_len: int
    blocks: list[Block]
    head: int = 0


@dataclass(slots=True)
class BackendStats:
    """What the backend did, for tests and profiles: calls by kind since start."""

    num_steps: int = 0
    num_decode_rows: int = 0
    num_head_rows: int = 0
    num_prefill_chunks: int = 0
    num_spans: int = 0
    calls: dict[str, int] = field(default_factory=dict)


class AttentionBackend:
    """How a model's steps attend: `plan` a step, `attend` one layer of it. Subclasses set `name` and `detail`."""

    name = "base"

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.device = pool.device
        self.stats = BackendStats()
        self.detail = self.name

    def plan(self, rows: list[StepRow], slot_mapping: torch.Tensor) -> StepMeta:
        raise NotImplementedError

    def attend(
        self,
        step: StepMeta,
        layer: int,
        query: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> None:
        """query [1, H, T, D] -> out [T, H, D], the step's K/V already in the pool."""
        raise NotImplementedError

    def write(self, step: StepMeta, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The step's new K/V [kv_heads, T, D] into their slots, before the layer attends."""
        self.pool.write(layer, step.slot_mapping, key, value)

    def rest(self) -> None:
        """No rows this step (the engine waits for work): what is kept across steps may go."""

    def kept_bytes(self) -> int:
        """Bytes of what it keeps across steps (the tiled backend's cascade head layouts; none otherwise)."""
        return 0

    # -- shared pieces -------------------------------------------------------------------------------------------
    def _count(self, meta: StepMeta) -> StepMeta:
        s = self.stats
        s.num_steps += 1
        s.num_spans += len(meta.spans)
        if meta.decode is not None:
            s.num_decode_rows += int(meta.decode.rows.numel())
            s.num_head_rows += sum(int(h.rows.numel()) for h in meta.decode.heads)
        if meta.prefill is not None:
            s.num_prefill_chunks += int(meta.prefill.q_starts.numel())
        return meta

    def _span(self, q_start: int, q_len: int, table: list[int], ctx_len: int) -> SeqSpan:
        bs = self.pool.block_size
        num_blocks = -(-ctx_len // bs)
        first = table[0]
        ctx_slots = None
        if table[:num_blocks] != list(range(first, first + num_blocks)):  # not one run: attention gathers
            ctx_slots = self._long(self.pool.slot_ids(table, 0, ctx_len))
        return SeqSpan(q_start, q_len, ctx_len, ctx_slots, first * bs, self.device)

    def _prefill_rows(self, chunks: list[tuple[int, int, int, list[int]]], copy: bool = True) -> PrefillRows:
        """Chunks (first row, tokens, keys, blocks) for the prefill kernel; `copy`: over an 8-bit pool the kernel
        reads a dequantized copy of their blocks (the C++ kernel; the Triton one dequantizes in place)."""
        bs = self.pool.block_size
        width = max(-(-ctx // bs) for _, _, ctx, _ in chunks)
        used = [table[: -(-ctx // bs)] for _, _, ctx, table in chunks]
        slots = None
        if copy and self.pool.is_quantized:  # the kernel reads a dequantized copy of these blocks: tables count in it
            order: dict[int, int] = {}
            for table in used:
                for block in table:
                    order.setdefault(block, len(order))
            used = [[order[block] for block in table] for table in used]
            slots = self._long(self.pool.slot_ids(list(order), 0, len(order) * bs))
        tables = [table + [0] * (width - len(table)) for table in used]
        int32 = self._int32
        starts, lens, ctxs = int32([c[0] for c in chunks]), int32([c[1] for c in chunks]), int32([c[2] for c in chunks])
        return PrefillRows(starts, lens, ctxs, int32(tables), slots)

    def _decode_rows(self, rows: list[DecodeRow], heads: list[SharedHead]) -> DecodeRows:
        width = max(len(r.table) for r in rows)
        padded = [r.table + [0] * (width - len(r.table)) for r in rows]
        int32 = self._int32
        lens = int32([r.ctx_len for r in rows])
        first_keys = int32([r.head for r in rows]) if heads else None
        return DecodeRows(int32([r.at for r in rows]), int32(padded), lens, heads, first_keys)

    @staticmethod
    def _token_rows(r: StepRow) -> list[DecodeRow]:
        """Deterministic mode: each of the row's tokens a decode row over its own keys (one order per position)."""
        start = r.ctx_len - r.num_tokens
        return [DecodeRow(r.at - start + p, r.table, p + 1, r.blocks) for p in range(start, r.ctx_len)]

    def _int32(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _prefill_kernel(self, step: StepMeta, layer: int, query: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        p = step.prefill
        assert p is not None
        pool = self.pool
        k_read, v_read = (pool.k[layer], pool.v[layer]) if p.slots is None else pool.read(layer, 0, 0, p.slots)
        torch.ops.kvserve.paged_prefill(
            query[0].transpose(0, 1),  # [T, H, D], a view
            k_read,
            v_read,
            out,
            p.q_starts,
            p.q_lens,
            p.context_lens,
            p.block_tables,
            pool.block_size,
            scale,
        )


class SdpaBackend(AttentionBackend):
    """Every row one SDPA call over its context: where our kernels cannot run (no compiler, not a CPU)."""

    name = SDPA_BACKEND

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self.detail = "every row one SDPA call"

    def plan(self, rows: list[StepRow], slot_mapping: torch.Tensor) -> StepMeta:
        spans = [self._span(r.at, r.num_tokens, r.table, r.ctx_len) for r in rows]
        return self._count(StepMeta(self.pool, slot_mapping, spans, backend=self))

    def attend(self, step, layer, query, out, scale, window, softcap) -> None:  # type: ignore[no-untyped-def]
        attend_spans(step, layer, query, out, scale, window, softcap)


class TiledBackend(AttentionBackend):
    """One walk for every row (see the module's docstring): decode rows by `paged_decode_rows`, rows sharing a long
    prefix resuming one head walk over it, prefill chunks by `paged_prefill` (or SDPA where timed faster)."""

    name = TILED_BACKEND

    def __init__(self, pool: KVPool, chunks_by_kernel: bool, head_layouts: HeadLayouts) -> None:
        super().__init__(pool)
        self.chunks_by_kernel = chunks_by_kernel
        self.head_layouts = head_layouts
        chunks = "the prefill kernel" if chunks_by_kernel else "SDPA"
        self.detail = f"tiled bf16 walk for decode rows and cascade heads; prefill chunks by {chunks}"

    def plan(self, rows: list[StepRow], slot_mapping: torch.Tensor) -> StepMeta:
        decode: list[DecodeRow] = []
        chunks: list[tuple[int, int, int, list[int]]] = []
        spans: list[SeqSpan] = []
        for r in rows:
            if r.num_tokens == 1:
                decode.append(DecodeRow(r.at, r.table, r.ctx_len, r.blocks))
            elif self.chunks_by_kernel:
                chunks.append((r.at, r.num_tokens, r.ctx_len, r.table))
            else:
                spans.append(self._span(r.at, r.num_tokens, r.table, r.ctx_len))
        meta = StepMeta(self.pool, slot_mapping, spans, backend=self)
        if decode:
            heads, with_heads = self._heads(decode)
            taken = {id(r) for r in with_heads}
            meta.decode = self._decode_rows(with_heads + [r for r in decode if id(r) not in taken], heads)
        else:
            self.head_layouts.for_step([])
        if chunks:
            meta.prefill = self._prefill_rows(chunks)
        return self._count(meta)

    def _heads(self, rows: list[DecodeRow]) -> tuple[list[SharedHead], list[DecodeRow]]:
        """Rows whose tables start with the same full blocks share them as a head: one walk over its keys (whole
        partitions, at least TILED_HEAD_MIN_KEYS) for all of them, resumed by each row's own walk."""
        bs = self.pool.block_size
        lead = -(-TILED_HEAD_MIN_KEYS // bs)  # blocks a head holds at least: rows are grouped by these
        groups: dict[tuple[int, ...], list[DecodeRow]] = {}
        for row in rows:
            if row.ctx_len > TILED_HEAD_MIN_KEYS and len(row.table) > lead:
                groups.setdefault(tuple(row.table[:lead]), []).append(row)
        found: list[tuple[list[DecodeRow], int, int]] = []  # (rows, head keys, head blocks)
        for group in groups.values():
            if len(group) < 2:
                continue
            limit = min((r.ctx_len - 1) // bs for r in group)  # whole blocks before every row's own token
            common = _common_prefix([r.table[:limit] for r in group])
            keys = min(common * bs, min(r.ctx_len - 1 for r in group)) // WALK_PARTITION * WALK_PARTITION
            if keys >= TILED_HEAD_MIN_KEYS:
                found.append((group, keys, -(-keys // bs)))
        stamps = [tuple(b.stamp for b in group[0].blocks[:n]) for group, _, n in found]
        laid_out = self.head_layouts.for_step(stamps)
        heads: list[SharedHead] = []
        taken: list[DecodeRow] = []
        for (group, keys, n), kept in zip(found, laid_out, strict=True):
            for r in group:
                r.head = keys
            table = group[0].table
            at = self._long([r.at for r in group])
            heads.append(SharedHead(at, keys, table[0] * bs, None, self._int32(table[:n]), kept))
            taken += group
        return heads, taken

    def attend(self, step, layer, query, out, scale, window, softcap) -> None:  # type: ignore[no-untyped-def]
        if step.prefill is not None:
            self._prefill_kernel(step, layer, query, out, scale)
        if step.decode is not None:
            d = step.decode
            k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
            first_keys = acc = run_max = run_sum = _EMPTY
            if d.first_keys is not None:
                acc, run_max, run_sum = _head_states(query, k_pool, v_pool, d.heads, scale, self.pool.block_size, layer)
                first_keys = d.first_keys
            torch.ops.kvserve.paged_decode_rows(
                query[0].transpose(0, 1),  # [T, H, D], a view
                k_pool,
                v_pool,
                out,
                d.rows,
                d.block_tables,
                d.context_lens,
                first_keys,
                acc,
                run_max,
                run_sum,
                self.pool.block_size,
                scale,
            )
        attend_spans(step, layer, query, out, scale, window, softcap)

    def rest(self) -> None:
        self.head_layouts.for_step([])

    def kept_bytes(self) -> int:
        return self.head_layouts.kept_bytes


def _head_states(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    heads: list[SharedHead],
    scale: float,
    block_size: int,
    layer: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's walk over its keys for its rows: acc [Bh, H, D], max and sum [Bh, H] (fp32), in the heads'
    order; from the layout kept for the head (made on first use) or laid out on this call."""
    num_heads, dim = query.shape[1], query.shape[3]
    accs, maxes, sums = [], [], []
    for head in heads:
        assert head.blocks is not None
        n = head.rows.numel()
        rows = query[0].index_select(1, head.rows).transpose(0, 1)  # [n, H, D]
        acc = torch.empty((n, num_heads, dim), dtype=torch.float32, device=rows.device)
        run_max = torch.empty((n, num_heads), dtype=torch.float32, device=rows.device)
        run_sum = torch.empty_like(run_max)
        if head.laid_out is not None:
            keys, values = head.laid_out.of_layer(layer, k_pool, v_pool, head.blocks, head.length)
            torch.ops.kvserve.shared_keys_from_layout(rows, keys, values, acc, run_max, run_sum, head.length, scale)
        else:
            torch.ops.kvserve.paged_shared_keys(
                rows, k_pool, v_pool, acc, run_max, run_sum, head.blocks, head.length, block_size, scale
            )
        accs.append(acc)
        maxes.append(run_max)
        sums.append(run_sum)
    if len(heads) == 1:
        return accs[0], maxes[0], sums[0]
    return torch.cat(accs), torch.cat(maxes), torch.cat(sums)


class KernelBackend(AttentionBackend):
    """The C++ decode kernel with SDPA (see the module's docstring). `lone_rows`: how a long decode row sharing no
    head goes (routing.KERNEL, SDPA or HEAD, timed at start); `uses_heads`: rows may share cascade heads (layers
    without window or softcap, K/V not quantized); `chunks_by_kernel`: prefill chunks by the prefill kernel over a
    dequantized copy (8-bit pools); `every_token`: deterministic mode, every token a kernel row over its own keys."""

    name = KERNEL_BACKEND

    def __init__(
        self,
        pool: KVPool,
        lone_rows: str,
        uses_heads: bool,
        chunks_by_kernel: bool = False,
        every_token: bool = False,
    ) -> None:
        super().__init__(pool)
        self.lone_rows, self.uses_heads = lone_rows, uses_heads
        self.chunks_by_kernel, self.every_token = chunks_by_kernel, every_token
        if every_token:
            self.detail = "the decode kernel for every token (one order per position)"
        else:
            chunks = "the prefill kernel" if chunks_by_kernel else "SDPA"
            heads = ", cascade heads by flash attention" if uses_heads else ""
            self.detail = f"the decode kernel for decode rows (long lone rows: {lone_rows}{heads}); chunks by {chunks}"

    def plan(self, rows: list[StepRow], slot_mapping: torch.Tensor) -> StepMeta:
        spans: list[SeqSpan] = []
        long_rows: list[DecodeRow] = []
        kernel_rows: list[DecodeRow] = []
        chunks: list[tuple[int, int, int, list[int]]] = []
        for r in rows:
            if self.every_token:
                kernel_rows += self._token_rows(r)
            elif r.num_tokens == 1:
                row = DecodeRow(r.at, r.table, r.ctx_len, r.blocks)
                (kernel_rows if r.ctx_len <= KERNEL_MAX_CONTEXT else long_rows).append(row)
            elif self.chunks_by_kernel:
                chunks.append((r.at, r.num_tokens, r.ctx_len, r.table))
            else:
                spans.append(self._span(r.at, r.num_tokens, r.table, r.ctx_len))
        heads, with_heads = self._heads(long_rows) if self.uses_heads else ([], [])
        for lone in long_rows:  # the rest: SDPA on a view of one run of blocks where that is faster, else the kernel
            if lone.head:
                continue
            if self.lone_rows == SDPA and _run_length(lone.table) * self.pool.block_size >= lone.ctx_len:
                spans.append(self._span(lone.at, 1, lone.table, lone.ctx_len))
            else:
                kernel_rows.append(lone)
        meta = StepMeta(self.pool, slot_mapping, spans, backend=self)
        if with_heads or kernel_rows:
            meta.decode = self._decode_rows(with_heads + kernel_rows, heads)
        if chunks:
            meta.prefill = self._prefill_rows(chunks)
        return self._count(meta)

    def _heads(self, rows: list[DecodeRow]) -> tuple[list[SharedHead], list[DecodeRow]]:
        """Cascade attention for long decode rows: the heads, and the rows that take one (in the heads' order).

        Rows whose tables start alike share their common full blocks as one head (one call reads them for
        all); a lone row's head is its leading run of consecutive blocks (a view, no gather) when heads are
        its fastest way, or SDPA's and the run does not hold its whole context (SDPA takes that whole, on a
        view). A row takes its head when the kernel is left at most max(KERNEL_MAX_CONTEXT, head) keys.
        """
        bs = self.pool.block_size
        groups: dict[int, list[DecodeRow]] = {}
        for row in rows:
            groups.setdefault(row.table[0], []).append(row)
        heads: list[SharedHead] = []
        taken: list[DecodeRow] = []
        for group in groups.values():
            limit = min((r.ctx_len - 1) // bs for r in group)  # whole blocks before every row's own token
            common = _common_prefix([r.table[:limit] for r in group])
            parts = [group] if len(group) > 1 and common * bs > KERNEL_MAX_CONTEXT else [[r] for r in group]
            for part in parts:
                table = part[0].table
                if len(part) > 1:
                    length = common
                elif self.lone_rows == KERNEL or (
                    self.lone_rows == SDPA and _run_length(table) * bs >= part[0].ctx_len
                ):
                    continue  # the kernel whole, or SDPA on a view of its one run of blocks, is faster
                else:
                    length = _run_length(table[: (part[0].ctx_len - 1) // bs])
                keep = [r for r in part if length and r.ctx_len - length * bs <= max(KERNEL_MAX_CONTEXT, length * bs)]
                if not keep:
                    continue
                for r in keep:
                    r.head = length * bs
                at = self._long([r.at for r in keep])
                heads.append(SharedHead(at, length * bs, table[0] * bs, self._head_slots(table[:length])))
                taken += keep
        return heads, taken

    def _head_slots(self, blocks: list[int]) -> torch.Tensor | None:
        """The head's slot ids when its blocks are not one run (a view serves when they are)."""
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            return None
        return self._long(self.pool.slot_ids(blocks, 0, len(blocks) * self.pool.block_size))

    def attend(self, step, layer, query, out, scale, window, softcap) -> None:  # type: ignore[no-untyped-def]
        if step.prefill is not None:
            self._prefill_kernel(step, layer, query, out, scale)
        if step.decode is not None:
            d = step.decode
            k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
            first_keys = head_out = head_lse = _EMPTY
            if d.first_keys is not None and window is None and softcap is None:
                first_keys, (head_out, head_lse) = d.first_keys, flash_heads(query, k_pool, v_pool, d.heads, scale)
            torch.ops.kvserve.paged_decode(
                query[0].transpose(0, 1),  # [T, H, D], a view
                k_pool,
                v_pool,
                out,
                d.rows,
                d.block_tables,
                d.context_lens,
                first_keys,
                head_out,
                head_lse,
                self.pool.block_size,
                window or 0,
                scale,
                softcap or 0.0,
            )
        attend_spans(step, layer, query, out, scale, window, softcap)


@dataclass(slots=True)
class TritonLaunch:
    """A step's Triton grids: the prefill programs' (chunk, first query) pairs, and the decode split kernel's
    partial results (made by the step's first layer, reused by the others)."""

    tiles: torch.Tensor | None = None  # [N, 2] int32
    max_keys: int = 0  # the longest decode row's keys: how many splits the workspace holds
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class TritonBackend(AttentionBackend):
    """The Triton kernels (see the module's docstring): decode rows by the split-K kernel, chunks by the prefill
    kernel, the K/V written by a kernel (quantized there for an 8-bit pool); `every_token`: deterministic mode."""

    name = TRITON_BACKEND

    def __init__(self, pool: KVPool, every_token: bool = False) -> None:
        super().__init__(pool)
        from server.kv import triton_attention  # triton is imported where this backend serves only

        self.kernels = triton_attention
        self.every_token = every_token
        if every_token:
            self.detail = f"Triton kernels, every token a decode row (splits of {triton_attention.SPLIT_KEYS} keys)"
        else:
            self.detail = (
                f"Triton kernels: decode rows split every {triton_attention.SPLIT_KEYS} keys, prefill chunks in place"
            )

    @staticmethod
    def self_test(pool: KVPool, num_heads: int) -> str | None:
        """None when the kernels run here and answer right for this pool's layout, else what failed (a triton that
        is installed but does not import, say)."""
        try:
            from server.kv import triton_attention
        except Exception as exc:  # whatever a broken triton raises while it is imported
            return " ".join(f"triton does not import: {type(exc).__name__}: {exc}".split())[:500]
        return triton_attention.self_test(pool.layout, pool.block_size, num_heads, pool.device)

    def plan(self, rows: list[StepRow], slot_mapping: torch.Tensor) -> StepMeta:
        decode: list[DecodeRow] = []
        chunks: list[tuple[int, int, int, list[int]]] = []
        for r in rows:
            if r.num_tokens == 1:
                decode.append(DecodeRow(r.at, r.table, r.ctx_len, r.blocks))
            elif self.every_token:
                decode += self._token_rows(r)
            else:
                chunks.append((r.at, r.num_tokens, r.ctx_len, r.table))
        meta = StepMeta(self.pool, slot_mapping, [], backend=self, launch=TritonLaunch())
        if decode:
            meta.decode = self._decode_rows(decode, [])
            meta.launch.max_keys = max(r.ctx_len for r in decode)
        if chunks:
            meta.prefill = self._prefill_rows(chunks, copy=False)
            meta.launch.tiles = self.kernels.prefill_tiles([c[1] for c in chunks], self.device)
        return self._count(meta)

    def write(self, step: StepMeta, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        pool = self.pool
        self.kernels.store_kv(pool.k[layer], pool.v[layer], step.slot_mapping, key, value, pool.is_quantized)

    def attend(self, step, layer, query, out, scale, window, softcap) -> None:  # type: ignore[no-untyped-def]
        pool, launch = self.pool, step.launch
        q = query[0].transpose(0, 1)  # [T, H, D], a view
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        if step.prefill is not None:
            p = step.prefill
            self.kernels.prefill(
                q, k_pool, v_pool, out, launch.tiles, p.q_starts, p.q_lens, p.context_lens, p.block_tables,
                pool.block_size, scale, window, softcap, pool.is_quantized,
            )  # fmt: skip
        if step.decode is not None:
            d = step.decode
            if launch.workspace is None:
                rows, (heads, dim) = d.rows.numel(), q.shape[1:]
                launch.workspace = self.kernels.decode_workspace(rows, heads, dim, launch.max_keys, self.device)
            self.kernels.decode(
                q, k_pool, v_pool, out, d.rows, d.block_tables, d.context_lens, launch.workspace,
                pool.block_size, scale, window, softcap, pool.is_quantized,
            )  # fmt: skip


def _common_prefix(tables: list[list[int]]) -> int:
    """How many leading blocks all these tables share."""
    n = min(len(t) for t in tables)
    first = tables[0]
    for i in range(n):
        if any(t[i] != first[i] for t in tables):
            return i
    return n


def _run_length(table: list[int]) -> int:
    """How many leading blocks of the table are consecutive block ids."""
    n = 1 if table else 0
    while n < len(table) and table[n] == table[0] + n:
        n += 1
    return n
