"""One continuous-batching step: pick the work, lay it out on the paged pool, one forward pass.

Decode tokens of every prefilled sequence come first; prefill chunks of the others fill the
rest of the per-step token budget, so a long prompt never stalls the running streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.block_manager import BlockManager
from server.engine.paged_attention import STEP_KWARG, KVPool, SeqSpan, StepMeta
from server.engine.sequence import Sequence
from server.engine.types import EngineError


class PagedSequence(Sequence):
    """A Sequence whose K/V lives in pool blocks (`fed_ids[i]` sits in slot i of `blocks`)."""

    def __init__(self, *args, is_prefix_caching: bool = True) -> None:
        super().__init__(*args)
        self.blocks: list = []
        self.num_reserved = 0  # blocks promised at admission, not allocated yet
        self.salt = self.request.tenant
        # Reuse and publish K/V only when both the server and the request allow it.
        self.use_cache = self.request.use_cache and is_prefix_caching

    def next_input(self, budget: int) -> list[int]:
        if self.is_prefilled:
            return [self.generated_ids[-1]]
        return self.request.prompt_ids[len(self.fed_ids) : len(self.fed_ids) + budget]


class QueueFull(EngineError):
    code = "server_overloaded"


class TooLarge(EngineError):
    code = "context_length_exceeded"


@dataclass(slots=True)
class PoolConfig:
    budget_bytes: int
    block_size: int = 16
    max_batch_tokens: int = 256
    max_queue: int = 64
    is_prefix_caching: bool = True


@dataclass(slots=True)
class DeviceUsage:
    num_tokens: int
    exclusive_bytes: int
    shared_bytes: int


@dataclass(slots=True)
class StepRecord:
    decode: list[str]  # request ids that fed one decode token
    prefill: list[tuple[str, int]]  # (request id, chunk length)


@dataclass(slots=True)
class Row:
    seq: PagedSequence
    token_ids: list[int]
    is_sampled: bool  # the row's last position yields the next token


SOLO_PREFILL_FACTOR = 4  # with no stream to keep flowing, a prefill chunk may be this much larger
MIN_PREFILL_CHUNK = 16  # however many streams decode, admitted prompts keep moving


def plan(running: list[PagedSequence], max_tokens: int) -> list[Row]:
    rows = [Row(s, s.next_input(1), True) for s in running if s.is_prefilled]
    # The per-step budget keeps running streams flowing during a long prefill. With none running it
    # would only add forward passes (each re-reads every weight): measured ~25% slower long prompts.
    budget = max(max_tokens - len(rows), MIN_PREFILL_CHUNK) if rows else max_tokens * SOLO_PREFILL_FACTOR
    for seq in running:
        if seq.is_prefilled or budget <= 0:
            continue
        chunk = seq.next_input(budget)
        is_last = len(seq.fed_ids) + len(chunk) == len(seq.request.prompt_ids)
        rows.append(Row(seq, chunk, is_last and not seq.request.is_prefill_only))
        budget -= len(chunk)
    return rows


def layout(rows: list[Row], manager: BlockManager, pool: KVPool) -> tuple[StepMeta, torch.Tensor, torch.Tensor, list]:
    """Allocate slots for the new tokens; build the packed ids, positions and attention metadata."""
    bs, device = manager.block_size, pool.device
    ids, positions, slots, spans, sampled_at = [], [], [], [], []
    for row in rows:
        seq, start = row.seq, len(row.seq.fed_ids)
        end = start + len(row.token_ids)
        while len(seq.blocks) * bs < end:
            prefer = seq.blocks[-1].block_id + 1 if seq.blocks else None
            seq.blocks.append(manager.allocate(prefer))
            seq.num_reserved -= 1
        table = [b.block_id for b in seq.blocks]
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        spans.append(_span(len(ids), len(row.token_ids), table, end, bs, device))
        ids += row.token_ids
        positions += range(start, end)
        if row.is_sampled:
            sampled_at.append(len(ids) - 1)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    meta = StepMeta(pool, slot_mapping, spans)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)  # [1, T]
    return meta, input_ids, position_ids, sampled_at


def _span(q_start: int, q_len: int, table: list[int], ctx: int, bs: int, device) -> SeqSpan:
    num_blocks = -(-ctx // bs)
    first = table[0]
    is_contiguous = table[:num_blocks] == list(range(first, first + num_blocks))
    ctx_slots = None
    if not is_contiguous:
        ctx_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)], dtype=torch.long, device=device)
    mask = None
    if q_len > 1:  # query i (at position ctx - q_len + i) sees keys 0 .. ctx - q_len + i
        keys = torch.arange(ctx, device=device)
        last_visible = ctx - q_len + torch.arange(q_len, device=device)
        mask = keys[None, :] <= last_visible[:, None]  # [q, ctx]
    return SeqSpan(q_start, q_len, ctx_slots, (first * bs, first * bs + ctx), mask)


def run_forward(model, meta: StepMeta, input_ids, position_ids, sampled_at: list[int]) -> torch.Tensor:
    """One packed forward pass; logits [R, V] for the sampled positions only."""
    keep = torch.tensor(sampled_at, dtype=torch.long, device=input_ids.device)
    with torch.inference_mode():
        out = model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep, **{STEP_KWARG: meta}
        )
    return out.logits[0]


def record(rows: list[Row], manager: BlockManager) -> None:
    """After a successful forward: the new tokens' K/V are in place; publish full and partial blocks."""
    bs = manager.block_size
    for row in rows:
        seq = row.seq
        first_block = len(seq.fed_ids) // bs
        seq.fed_ids.extend(row.token_ids)  # in place: this runs once per decoded token
        if not seq.is_prefilled and len(seq.fed_ids) == len(seq.request.prompt_ids):
            seq.is_prefilled = True
        if not seq.use_cache:
            continue
        for index in range(first_block, -(-len(seq.fed_ids) // bs)):
            parent = seq.blocks[index - 1].hash if index else manager.root(seq.salt)
            manager.record(seq.blocks[index], parent, seq.fed_ids[index * bs : (index + 1) * bs])
