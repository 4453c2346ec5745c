"""The model runner: the model, its K/V pool, and one packed forward pass per step.

It owns the pool's tensors: a step's forward pass writes the new tokens' K/V, and at admission it
writes reused K/V into the blocks the scheduler gives (a snapshot's tokens, a partial block's copy).

The rows of a step are laid out as one packed row ([1, T]): input ids, positions, the pool
slot each new token's K/V goes to, and per sequence where its queries sit in the row and
where its context sits in the pool. transformers hands that metadata (a forward kwarg) to the
paged attention function of every layer (server/kv/attention.py); logits are computed for the
sampled positions only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from server.engine.compiled import WARM_UP_TOKENS, CompiledModel
from server.engine.scheduler import Row
from server.kv import kernels, offload
from server.kv.attention import (
    DecodeRows,
    PrefillRows,
    SeqSpan,
    SharedHead,
    StepMeta,
    attention_inputs,
    install,
    stepping,
)
from server.kv.blocks import Block
from server.kv.head_layouts import HeadLayouts
from server.kv.pool import KVLayout, KVPool
from server.kv.routing import HEAD, KERNEL, SDPA, LoneRowRoute, time_lone_row, time_prefill
from server.kv.snapshot import Snapshot
from server.models.digest import ModelDigests
from server.models.loader import LoadedModel
from server.models.packed_linear import batch_invariance, pad_rows

log = logging.getLogger("kvserve.engine")

# Decode rows with at most this many keys go to the paged kernel, all in one call: it saves SDPA's per-call
# cost, which is most of a short row's time (bench/attention_cost.py). A longer row shares a head with the rows
# whose blocks start alike (cascade attention, `_heads`); a lone one goes the way timed fastest on this machine
# at start (server/kv/routing.py): the kernel whole, SDPA on a view when its blocks are one run, or a head of its
# leading run that the kernel resumes. SDPA never reads gathered slots for a decode row (the kernel is cheaper).
KERNEL_MAX_CONTEXT = 256


@dataclass(slots=True)
class DecodeRow:
    """A single-token row bound for the kernel: where it sits, its blocks, its keys and its head (0: none)."""

    at: int
    table: list[int]
    ctx_len: int
    blocks: list[Block]
    head: int = 0


@dataclass(slots=True)
class ForwardCounter:
    """Tokens fed to the model, by phase: the proof behind `cached_tokens` in tests."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_forwards: int = 0


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        budget_bytes: int,
        block_size: int,
        compile_dir: str | None = None,
        kv_dtype: torch.dtype | None = None,
        deterministic: bool = False,
    ) -> None:
        """`kv_dtype`: the quantized format the pool stores K/V in (None: the compute dtype); `deterministic`: make
        a token's K/V and logits independent of the step it is computed in (`_deterministic`)."""
        self.model = loaded.model
        self.device = loaded.device
        self.layout = KVLayout.of(loaded.model.config, loaded.dtype, kv_dtype)
        num_blocks = max(1, budget_bytes // (self.layout.bytes_per_token * block_size))
        self.pool = KVPool(self.layout, num_blocks, block_size, loaded.device)
        self.digests = loaded.digests or ModelDigests.of_loaded(loaded.model, loaded.tokenizer)
        self.fingerprint = self.layout.fingerprint(self.digests.text)
        self.counter = ForwardCounter()
        # Short decode rows go to the paged kernel in one call per layer (CPU); otherwise each is an SDPA call.
        self.uses_kernel = loaded.device.type == "cpu" and kernels.paged_decode_available()
        # Cascade attention (long decode rows: a batched head, the kernel for the rest) needs layers without a
        # window or softcap; the kernel would take such rows whole, slower than SDPA.
        # A quantized pool: every decode row goes to the kernel, which dequantizes the keys it reads (heads and SDPA
        # would dequantize whole contexts first), and prefill chunks attend over their dequantized context.
        quantized = self.layout.is_quantized
        plain_layers = not {"sliding_window", "softcap"} & attention_inputs(loaded.model)
        serves_prefill = self.uses_kernel and kernels.paged_prefill_available(self.layout.dtype, self.layout.head_dim)
        self.deterministic, self.deterministic_detail = False, "off"
        self.prefill_kernel = False
        if deterministic:
            self._deterministic(loaded, serves_prefill and plain_layers and not quantized)
        else:
            pad_rows(loaded.model, 1)
        self.uses_heads = self.uses_kernel and not quantized and plain_layers and not self.deterministic
        self.lone_rows = KERNEL if self.uses_kernel and (quantized or self.deterministic) else SDPA  # a long row's way
        if self.uses_kernel and not quantized and not self.deterministic:  # timed where there is a choice
            text = loaded.model.config.get_text_config(decoder=True)
            route: LoneRowRoute = time_lone_row(self.pool, int(text.num_attention_heads))
            self.lone_rows = (
                route.way
                if self.uses_heads or route.way != HEAD
                else min((KERNEL, SDPA), key=route.times_us.__getitem__)
            )
            log.info("model %s: %s", loaded.spec.id, route.describe)
        # Prefill chunks: the paged prefill kernel where it serves this pool and was timed faster than SDPA (layers
        # without window or softcap, as for heads); deterministic mode has chosen already.
        if quantized and serves_prefill and plain_layers and not self.deterministic:
            # Over a quantized pool the alternative is SDPA with a mask over the dequantized context: 65 ms a layer
            # for a 1,024-token chunk here; with the kernel (over a dequantized copy of the chunk's blocks) a
            # 2,000-token prefill took 1.8 s against 3.6 s
            self.prefill_kernel = True
        elif self.uses_heads and serves_prefill:
            text = loaded.model.config.get_text_config(decoder=True)
            prefill = time_prefill(self.pool, int(text.num_attention_heads))
            self.prefill_kernel = prefill.way == KERNEL
            log.info("model %s: %s", loaded.spec.id, prefill.describe)
        # Heads the kernel reads keep their layout across steps (within a quarter of the pool, at most 256 MiB).
        self.head_layouts = HeadLayouts.for_pool(self.layout, block_size, self.pool.nbytes)
        install(loaded.model)
        # What runs the steps, said in GET /v1/models/{id}: the compiled graphs, or eager and why
        self.compiled: CompiledModel | None = None
        self.compile_detail = "not asked (--compile false)"
        if compile_dir is not None and self.deterministic:
            self.compile_detail = (
                "asked, but runs eager: deterministic mode (inductor's kernels are not batch-invariant)"
            )
            log.info("model %s: not compiled: inductor's kernels are not batch-invariant", loaded.spec.id)
        elif compile_dir is not None:
            self.compiled, self.compile_detail = _compiled(loaded, compile_dir)

    def _deterministic(self, loaded: LoadedModel, by_prefill_kernel: bool) -> None:
        """Deterministic mode: a token's K/V and logits depend on its tokens alone, not on the step's other rows,
        where its prompt was cut into chunks or which K/V was cached (docs/architecture.md). Every token's
        attention, decode rows' included, is computed by one kernel, in one order that depends on its position
        only: the paged prefill kernel where it serves this pool (`by_prefill_kernel`: a decode row is a span of
        one token), else the paged decode kernel (a prefill chunk is one row per token); no cascade head, no
        SDPA, no timed choice. The linear layers are made batch-invariant as measured (`batch_invariance`)."""
        name = loaded.spec.id
        ways = batch_invariance(loaded.model) if self.uses_kernel else None
        if ways is None:
            why = "needs the paged kernel" if not self.uses_kernel else "its linear layers are not batch-invariant"
            self.deterministic_detail = f"unavailable: {why} on {loaded.device.type} in {loaded.dtype}"
            log.warning("model %s: deterministic mode %s", name, self.deterministic_detail)
            pad_rows(loaded.model, 1)
            return
        self.deterministic, self.prefill_kernel = True, by_prefill_kernel
        kernel = "the prefill kernel" if by_prefill_kernel else "the decode kernel"
        products = ", ".join(f"{n} {way}" for way, n in ways.items())
        self.deterministic_detail = f"on: attention by {kernel}, linear products {products}"
        log.info("model %s: deterministic mode %s", name, self.deterministic_detail)

    def run(self, rows: list[Row]) -> torch.Tensor:
        """One forward pass over the rows; logits [R, V] for the rows that sample, in row order."""
        meta, input_ids, position_ids, sampled_at = self._prepare(rows)
        with torch.inference_mode(), stepping(meta):
            if self.compiled is not None:
                logits: torch.Tensor = self.compiled(input_ids, position_ids, sampled_at)
            else:
                out = self.model(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=sampled_at
                )
                logits = out.logits[0]
        self._count(rows)
        return logits

    def write_snapshot(self, block_ids: list[int], snapshot: Snapshot, first: int, num_tokens: int) -> None:
        """The snapshot's tokens `first`..`num_tokens`-1 into these blocks (once its copy to the host landed)."""
        offload.restore(self.pool, block_ids, snapshot, first, num_tokens)

    def copy_slots(self, src_block: int, dst_block: int, num_slots: int) -> None:
        """A prompt diverging inside a cached block: its new block starts as a copy of the matching slots."""
        self.pool.copy_slots(src_block, dst_block, num_slots)

    def rest(self) -> None:
        """No rows this step (the engine waits for work): the heads' kept layouts are not needed, their memory goes."""
        self.head_layouts.for_step([])

    def _prepare(self, rows: list[Row]) -> tuple[StepMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed ids and positions, the slot mapping and one span per row (blocks are allocated)."""
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        sampled_at: list[int] = []
        long_rows: list[DecodeRow] = []
        kernel_rows: list[DecodeRow] = []
        chunks: list[tuple[int, int, int, list[int]]] = []  # prefill kernel: (first row, tokens, keys, blocks)
        for row in rows:
            start = row.seq.num_computed
            end = start + len(row.token_ids)
            table = [b.block_id for b in row.seq.blocks]
            slots += self.pool.slot_ids(table, start, end)
            if self.deterministic and self.prefill_kernel:  # every row a span, a decode row one of one token
                chunks.append((len(ids), len(row.token_ids), end, table))
            elif self.deterministic:  # every token a decode kernel row over its own keys
                at = len(ids) - start
                kernel_rows += [DecodeRow(at + p, table, p + 1, row.seq.blocks) for p in range(start, end)]
            elif self.uses_kernel and len(row.token_ids) == 1:
                decode_row = DecodeRow(len(ids), table, end, row.seq.blocks)
                (kernel_rows if end <= KERNEL_MAX_CONTEXT else long_rows).append(decode_row)
            elif self.prefill_kernel and len(row.token_ids) > 1:
                chunks.append((len(ids), len(row.token_ids), end, table))
            else:
                spans.append(self._span(len(ids), len(row.token_ids), table, end))
            ids += row.token_ids
            positions += range(start, end)
            if row.is_sampled:
                sampled_at.append(len(ids) - 1)
        heads, with_heads = self._heads(long_rows) if self.uses_heads else ([], [])
        for r in long_rows:  # the rest: SDPA on a view of one run of blocks where that is faster, else the kernel
            if r.head:
                continue
            if self.lone_rows == SDPA and _run_length(r.table) * self.pool.block_size >= r.ctx_len:
                spans.append(self._span(r.at, 1, r.table, r.ctx_len))
            else:
                kernel_rows.append(r)
        meta = StepMeta(self.pool, torch.tensor(slots, dtype=torch.long, device=device), spans)
        if with_heads or kernel_rows:
            meta.decode = self._decode_rows(with_heads + kernel_rows, heads)
        if chunks:
            meta.prefill = self._prefill_rows(chunks)
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
        position_ids = torch.tensor([positions], dtype=torch.long, device=device)  # [1, T]
        return meta, input_ids, position_ids, torch.tensor(sampled_at, dtype=torch.long, device=device)

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
        found: list[tuple[list[DecodeRow], int, list[int]]] = []  # (rows, head length in blocks, table)
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
                if keep:
                    found.append((keep, length, table))
        # read in place by the kernel, once for the rows sharing it, from a layout kept across steps where one fits
        # (a lone row's head: flash, cheaper for one row)
        by_kernel = [self.prefill_kernel and len(keep) > 1 for keep, _, _ in found]
        stamps = [
            tuple(b.stamp for b in keep[0].blocks[:n]) for (keep, n, _), k in zip(found, by_kernel, strict=True) if k
        ]
        laid_out = iter(self.head_layouts.for_step(stamps))
        heads: list[SharedHead] = []
        taken: list[DecodeRow] = []
        for (keep, length, table), kernel in zip(found, by_kernel, strict=True):
            for r in keep:
                r.head = length * bs
            at = self._long([r.at for r in keep])
            if kernel:
                heads.append(
                    SharedHead(at, length * bs, table[0] * bs, None, self._int32(table[:length]), next(laid_out))
                )
            else:
                heads.append(SharedHead(at, length * bs, table[0] * bs, self._head_slots(table[:length])))
            taken += keep
        return heads, taken

    def _head_slots(self, blocks: list[int]) -> torch.Tensor | None:
        """The head's slot ids when its blocks are not one run (a view serves when they are)."""
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            return None
        return self._long(self.pool.slot_ids(blocks, 0, len(blocks) * self.pool.block_size))

    def _decode_rows(self, rows: list[DecodeRow], heads: list[SharedHead]) -> DecodeRows:
        width = max(len(r.table) for r in rows)
        padded = [r.table + [0] * (width - len(r.table)) for r in rows]
        int32 = self._int32
        lens = int32([r.ctx_len for r in rows])
        first_keys = int32([r.head for r in rows]) if heads else None
        return DecodeRows(int32([r.at for r in rows]), int32(padded), lens, heads, first_keys)

    def _prefill_rows(self, chunks: list[tuple[int, int, int, list[int]]]) -> PrefillRows:
        bs = self.pool.block_size
        width = max(-(-ctx // bs) for _, _, ctx, _ in chunks)
        used = [table[: -(-ctx // bs)] for _, _, ctx, table in chunks]
        slots = None
        if self.layout.is_quantized:  # the kernel reads a dequantized copy of these blocks: tables count in it
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

    def _int32(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _span(self, q_start: int, q_len: int, table: list[int], ctx_len: int) -> SeqSpan:
        bs = self.pool.block_size
        num_blocks = -(-ctx_len // bs)
        first = table[0]
        ctx_slots = None
        if table[:num_blocks] != list(range(first, first + num_blocks)):  # not one run: attention gathers
            ctx_slots = torch.tensor(self.pool.slot_ids(table, 0, ctx_len), dtype=torch.long, device=self.device)
        return SeqSpan(q_start, q_len, ctx_len, ctx_slots, first * bs, self.device)

    def _count(self, rows: list[Row]) -> None:
        for row in rows:
            if row.seq.is_prefilled:
                self.counter.num_decode_tokens += len(row.token_ids)
            else:
                self.counter.num_prefill_tokens += len(row.token_ids)
        self.counter.num_forwards += 1


def _compiled(loaded: LoadedModel, cache_dir: str) -> tuple[CompiledModel | None, str]:
    """The model compiled (both graphs, now), or None where it runs eager (with the reason logged); and what it
    runs, in words."""
    if loaded.device.type != "cpu":
        log.warning("model %s: not compiled: compiling is built for the CPU only (%s)", loaded.spec.id, loaded.device)
        return None, f"asked, but runs eager: compiling is built for the CPU only, not {loaded.device.type}"
    compiled = CompiledModel(loaded.model, Path(cache_dir), loaded.spec.id)
    if not compiled.head_matches():
        log.warning("model %s: not compiled: its LM head does more than a linear layer and a softcap", loaded.spec.id)
        return None, "asked, but runs eager: its LM head does more than a linear layer and a softcap"
    try:
        compiled.compile()
    except Exception as exc:  # a graph break, no C++ compiler, an inductor error: the model still serves, eager
        log.exception("model %s: not compiled: compiling failed; it runs eager", loaded.spec.id)
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return None, f"asked, but runs eager: compiling failed ({cause})"
    cached = f"{compiled.cache_hits} of {len(WARM_UP_TOKENS)} graphs from the cache"
    return compiled, f"compiled by torch.compile at start in {compiled.compile_s:.1f} s ({cached})"


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
