"""The model runner: the model, its K/V pool, and one packed forward pass per step.

The rows of a step are laid out as one packed row ([1, T]): input ids, positions, the pool
slot each new token's K/V goes to, and per sequence where its queries sit in the row and
where its context sits in the pool. transformers hands that metadata (a forward kwarg) to the
paged attention function of every layer (server/kv/attention.py); logits are computed for the
sampled positions only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.scheduler import Row
from server.kv import kernels
from server.kv.attention import STEP_KWARG, DecodeRows, SeqSpan, StepMeta, install
from server.kv.pool import KVLayout, KVPool, weights_digest
from server.models.loader import LoadedModel

# Decode rows with at most this many keys go to the paged kernel, all in one call; longer ones to SDPA, one call
# each. Measured on a 2-core Xeon (bench/attention_cost.py): the kernel saves SDPA's per-call cost, which is most
# of a short row's time, but streams a long context slower than SDPA's flash kernel (they cross at 256-384 keys).
KERNEL_MAX_CONTEXT = 256


@dataclass(slots=True)
class ForwardCounter:
    """Tokens fed to the model, by phase: the proof behind `cached_tokens` in tests."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_forwards: int = 0


class ModelRunner:
    def __init__(self, loaded: LoadedModel, budget_bytes: int, block_size: int) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.layout = KVLayout.of(loaded.model.config, loaded.dtype)
        num_blocks = max(1, budget_bytes // (self.layout.bytes_per_token * block_size))
        self.pool = KVPool(self.layout, num_blocks, block_size, loaded.device)
        self.fingerprint = self.layout.fingerprint(loaded.weights_digest or weights_digest(loaded.model))
        self.counter = ForwardCounter()
        # Short decode rows go to the paged kernel in one call per layer (CPU); otherwise each is an SDPA call.
        self.uses_kernel = loaded.device.type == "cpu" and kernels.paged_decode_available()
        install(loaded.model)

    def run(self, rows: list[Row]) -> torch.Tensor:
        """One forward pass over the rows; logits [R, V] for the rows that sample, in row order."""
        meta, input_ids, position_ids, sampled_at = self._prepare(rows)
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=sampled_at,
                **{STEP_KWARG: meta},
            )
        self._count(rows)
        logits: torch.Tensor = out.logits[0]
        return logits

    def _prepare(self, rows: list[Row]) -> tuple[StepMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed ids and positions, the slot mapping and one span per row (blocks are allocated)."""
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        sampled_at: list[int] = []
        decode_rows: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        for row in rows:
            start = row.seq.num_computed
            end = start + len(row.token_ids)
            table = [b.block_id for b in row.seq.blocks]
            slots += self.pool.slot_ids(table, start, end)
            if self.uses_kernel and len(row.token_ids) == 1 and end <= KERNEL_MAX_CONTEXT:
                decode_rows.append(len(ids))
                tables.append(table)
                context_lens.append(end)
            else:
                spans.append(self._span(len(ids), len(row.token_ids), table, end))
            ids += row.token_ids
            positions += range(start, end)
            if row.is_sampled:
                sampled_at.append(len(ids) - 1)
        meta = StepMeta(self.pool, torch.tensor(slots, dtype=torch.long, device=device), spans)
        if decode_rows:
            meta.decode = self._decode_rows(decode_rows, tables, context_lens)
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
        position_ids = torch.tensor([positions], dtype=torch.long, device=device)  # [1, T]
        return meta, input_ids, position_ids, torch.tensor(sampled_at, dtype=torch.long, device=device)

    def _decode_rows(self, rows: list[int], tables: list[list[int]], context_lens: list[int]) -> DecodeRows:
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]

        def int32(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        return DecodeRows(int32(rows), int32(padded), int32(context_lens))

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
