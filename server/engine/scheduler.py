"""The scheduler: who waits, who runs, what each admitted sequence reuses, and what one step computes.

It decides and returns data; the loop carries its decisions out and the model runner does the tensor
work. It holds the block books (reservations, pins, which blocks a sequence holds, what is published)
and reads the tiers below the pool through a narrow view (`LowerTiers`): no model, no pool, no copies.

Admission is first come, first served, by block reservation: a sequence starts only when the
blocks for its prompt and max_tokens (less the shared ones it reuses) can be promised, so a
running stream is never preempted. One exception: a prompt whose prefix a running prefill of the
same tenant is computing waits for its blocks (those behind it may go meanwhile), then shares them.
At admission it decides, once, where the prompt's K/V comes from: blocks already in the pool
(shared whole, or a partial block copied), a host or disk snapshot (read first, off the engine
thread: the sequence is LOADING meanwhile), or nothing (computed). It also says how many blocks
the pass reserved beyond the free ones: idle sessions holding that many go down a tier before any
of them is allocated (allocating is what evicts cached blocks). A step is one decode token for
every prefilled sequence, then prefill chunks of the others up to the token budget, so a long
prompt never stalls running streams.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from server.engine.config import EngineConfig
from server.engine.sequence import Sequence, SequenceStatus
from server.kv.blocks import Block, BlockManager, Match
from server.kv.snapshot import Snapshot
from server.sessions.record import SessionKey, common_prefix_len

SOLO_PREFILL_FACTOR = 4  # with no stream to keep flowing, a prefill chunk may be this much larger
MIN_PREFILL_CHUNK = 16  # however many streams decode, admitted prompts keep moving
MIN_SHARED_BLOCKS = 2  # a prompt waits for a running prefill computing at least this many of its blocks


class LowerTiers(Protocol):
    """What admission reads of the tiers below the pool (the `Offloader` answers it)."""

    def fits(self, snapshot: Snapshot) -> bool: ...  # this model's K/V, computed as the pool computes it

    def can_restore(self, key: SessionKey, num_in_pool: int) -> bool: ...


@dataclass(slots=True, frozen=True)
class Admission:
    """How one sequence starts; the loop carries it out (the runner writes reused K/V) and tells the client."""

    seq: Sequence
    load: SessionKey | None = None  # read this session's snapshot first (the sequence is LOADING)
    shared: tuple[Block, ...] = ()  # full blocks reused as they are (pinned)
    partial: Block | None = None  # a cached block (pinned until copied) whose first `num_partial` slots are copied
    num_partial: int = 0
    restore: Snapshot | None = None  # write its tokens past `shared` up to `num_restore`
    num_restore: int = 0

    @property
    def num_cached(self) -> int:
        if self.restore is not None:
            return self.num_restore
        return sum(len(b.token_ids) for b in self.shared) + self.num_partial

    @property
    def source(self) -> str:
        if self.restore is not None:
            return self.restore.origin
        return "device" if self.num_cached else "none"


@dataclass(slots=True, frozen=True)
class AdmissionPlan:
    """One admission pass: who starts, and how many blocks its reservations took beyond the free ones."""

    admissions: list[Admission]
    # The largest shortfall of the pass (the first sequence refused included): allocating the reserved blocks
    # may evict this many cached ones, so idle sessions holding that many are copied down a tier first.
    num_short: int = 0


@dataclass(slots=True, frozen=True)
class Row:
    """One sequence's part of a step's packed row."""

    seq: Sequence
    token_ids: list[int]
    is_sampled: bool  # the row's last position yields the next token


class Scheduler:
    def __init__(self, manager: BlockManager, config: EngineConfig, tiers: LowerTiers) -> None:
        self.manager, self.config, self.tiers = manager, config, tiers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []

    @property
    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.loading)

    def add(self, seq: Sequence) -> None:
        seq.use_cache = seq.use_cache and self.config.is_prefix_caching
        self.waiting.append(seq)

    def sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting, *self.loading]

    # -- admission ------------------------------------------------------------------------
    def admit(self) -> AdmissionPlan:
        """Admit from the head of the queue while blocks can be reserved; loads leave the queue meanwhile."""
        loaded = [s for s in self.loading if s.loading is not None and s.loading.done()]
        for seq in loaded:
            self.loading.remove(seq)
            seq.snapshot, seq.loading, seq.status = _result(seq), None, SequenceStatus.WAITING
        self.waiting.extendleft(reversed(loaded))  # back at the head, in their order of arrival
        admitted, num_short = [], 0
        for seq in list(self.waiting):
            # Asked only of a prompt that may be admitted, or that shares blocks a leader has not computed yet
            match = functools.cache(functools.partial(self._match, seq))
            if self._awaits_leader(seq, match):
                continue  # stays in the queue; those behind it may go
            admission, short = self._plan(seq, match())
            num_short = max(num_short, short)
            if admission is None:
                break
            self.waiting.remove(seq)
            if admission.load is not None:
                seq.status, seq.has_looked_down = SequenceStatus.LOADING, True
                self.loading.append(seq)
            else:
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            admitted.append(admission)
        return AdmissionPlan(admitted, num_short)

    def _match(self, seq: Sequence) -> Match | None:
        """What the pool holds of the prompt, all but its last token (computed anyway, for its logits)."""
        return self.manager.match(seq.salt, seq.request.prompt_ids, seq.num_prompt - 1) if seq.use_cache else None

    def _awaits_leader(self, seq: Sequence, match: Callable[[], Match | None]) -> bool:
        """Whether a running prefill of the same tenant is computing blocks of this prompt's prefix right now.

        Conversations that open with the same new system prompt at once would each compute it; the first
        computes it, the others wait until its blocks are published and then share them, computing only
        their own rest. The wait ends when the leader's blocks are in the pool, or when it leaves.

        Only blocks still to come are worth a wait. Those the pool holds (`match`: cached, or published by the
        leader) are shared at once, including what a leader admitted a moment ago in this same call found cached:
        its `num_computed` is still 0, so comparing with it alone admitted prompts behind one cached system prompt
        one per step. A leader admitted here with a snapshot to restore holds its followers back one step: its
        blocks are published before the next admission and shared then, not computed twice.
        """
        if not seq.use_cache:
            return False
        bs, prompt = self.config.block_size, seq.request.prompt_ids
        for leader in self.running:
            if leader.is_prefilled or not leader.use_cache or leader.salt != seq.salt:
                continue
            shared = min(common_prefix_len(leader.request.prompt_ids, prompt), len(prompt) - 1) // bs
            if shared < MIN_SHARED_BLOCKS or shared <= leader.num_computed // bs:
                continue
            found = match()  # the full blocks of this prompt the pool can give now
            if shared > (len(found.shared) if found is not None else 0):
                return True
        return False

    def _plan(self, seq: Sequence, match: Match | None) -> tuple[Admission | None, int]:
        """The sequence's admission (`match`: what the pool holds of its prompt), or None when its blocks cannot be
        reserved yet; and how many blocks its reservation asks for beyond the free ones not yet promised."""
        bs = self.config.block_size
        num_in_pool = match.num_tokens if match else 0
        source = seq.request.kv_source
        if source is not None and seq.use_cache and not seq.has_looked_down and self._holds_more(source, num_in_pool):
            return Admission(seq, load=source), 0  # reserves nothing until the snapshot is read
        shared = list(match.shared) if match else []
        num_restore = self._restorable(seq, num_in_pool)
        if num_restore:
            shared = shared[: num_restore // bs]
        # A partially matching block is pinned too until its slots are copied: another admission's allocation
        # in the same step must not evict it and write over it first.
        partial = match.partial if match is not None and not num_restore else None
        pinned = shared + ([partial] if partial is not None else [])
        need = -(-seq.max_len // bs) - len(shared)
        short = need - (self.manager.num_free - self.manager.num_reserved)  # asked before it may be refused
        if not self.manager.can_reserve(need, pinned):
            return None, short
        self.manager.reserve(need)
        self.manager.pin(pinned)
        seq.blocks, seq.num_reserved, seq.copy_source = list(shared), need, partial
        if num_restore:
            assert seq.snapshot is not None
            return Admission(seq, shared=tuple(shared), restore=seq.snapshot, num_restore=num_restore), short
        if partial is not None:
            assert match is not None
            return Admission(seq, shared=tuple(shared), partial=partial, num_partial=match.num_partial), short
        return Admission(seq, shared=tuple(shared)), short

    def _holds_more(self, source: SessionKey, num_in_pool: int) -> bool:
        """A host or disk snapshot of `source`, or the shared tier, may hold more tokens than the pool matched
        (read it to see)."""
        return self.tiers.can_restore(source, num_in_pool)

    def _restorable(self, seq: Sequence, num_in_pool: int) -> int:
        """Prompt tokens the sequence's snapshot holds beyond what the pool does (0: use the pool)."""
        snapshot = seq.snapshot
        if snapshot is None or not seq.use_cache or not self.tiers.fits(snapshot):
            return 0
        prompt = seq.request.prompt_ids
        num_tokens = min(common_prefix_len(snapshot.token_ids, prompt), len(prompt) - 1)
        return num_tokens if num_tokens > num_in_pool else 0

    # -- steps ------------------------------------------------------------------------------
    def schedule(self) -> list[Row]:
        """This step's rows: decode tokens first, then prefill chunks in arrival order; slots allocated."""
        budget = self.config.max_batch_tokens
        rows = [Row(s, s.next_input(1), True) for s in self.running if s.is_prefilled]
        # The per-step budget keeps running streams flowing during a long prefill. With none running it
        # would only add forward passes (each re-reads every weight): measured ~25% slower long prompts.
        budget = max(budget - len(rows), MIN_PREFILL_CHUNK) if rows else budget * SOLO_PREFILL_FACTOR
        for seq in self.running:
            if seq.is_prefilled or budget <= 0:
                continue
            chunk = seq.next_input(budget)
            is_last = seq.num_computed + len(chunk) == seq.num_prompt
            rows.append(Row(seq, chunk, is_last and not seq.request.is_prefill_only))
            budget -= len(chunk)
        for row in rows:
            self.allocate(row.seq, row.seq.num_computed + len(row.token_ids))
        return rows

    # -- reused K/V: the blocks it is written into ----------------------------------------------
    def blocks_to_fill(self, admission: Admission) -> list[Block]:
        """The new blocks (from the reservation, after `shared`) the admission's reused K/V is written into: a
        snapshot's tokens, or the partially matching block's slots."""
        seq = admission.seq
        self.allocate(seq, admission.num_cached)
        return seq.blocks[len(admission.shared) :]

    def publish_filled(self, admission: Admission) -> None:
        """The reused K/V is in the blocks `blocks_to_fill` gave: the sequence holds it; publish those blocks."""
        admission.seq.num_computed = admission.num_cached
        self.publish(admission.seq, len(admission.shared))

    def unfill(self, admission: Admission) -> None:
        """Writing a snapshot failed: its blocks go back to the reservation, their contents forgotten (nothing was
        published, so no one can see them)."""
        seq, num_shared = admission.seq, len(admission.shared)
        filled = seq.blocks[num_shared:]
        del seq.blocks[num_shared:]
        self.manager.release(filled, keep_contents=False)
        self.manager.reserve(len(filled))
        seq.num_reserved += len(filled)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks (from the reservation) until the sequence's blocks hold `num_tokens` slots."""
        while len(seq.blocks) * self.config.block_size < num_tokens:
            prefer = seq.blocks[-1].block_id + 1 if seq.blocks else None
            seq.blocks.append(self.manager.allocate(prefer))
            seq.num_reserved -= 1

    def commit(self, rows: list[Row]) -> None:
        """After a forward pass: the rows' K/V are in place; publish the blocks they filled."""
        bs = self.config.block_size
        for row in rows:
            seq = row.seq
            first_block = seq.num_computed // bs
            seq.num_computed += len(row.token_ids)
            if seq.use_cache:
                self.publish(seq, first_block)

    def publish(self, seq: Sequence, first_block: int) -> None:
        """Record the blocks from `first_block` on under their prefix hashes (full ones shareable)."""
        bs = self.config.block_size
        for index in range(first_block, -(-seq.num_computed // bs)):
            parent = seq.blocks[index - 1].hash if index else self.manager.root(seq.salt)
            assert parent is not None  # every block before it is full
            tokens = seq.token_ids[index * bs : min((index + 1) * bs, seq.num_computed)]
            self.manager.record(seq.blocks[index], parent, tokens)

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out, giving back its blocks and reservation. False when it had finished already."""
        if seq.status is SequenceStatus.FINISHED:
            return False
        queues: dict[SequenceStatus, deque[Sequence] | list[Sequence]] = {
            SequenceStatus.WAITING: self.waiting,
            SequenceStatus.LOADING: self.loading,
            SequenceStatus.RUNNING: self.running,
        }
        queues[seq.status].remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.unpin_copy_source(seq)
        self.manager.release(seq.blocks, keep_contents=seq.use_cache)
        self.manager.unreserve(seq.num_reserved)
        seq.blocks, seq.num_reserved = [], 0
        return True

    def unpin_copy_source(self, seq: Sequence) -> None:
        if seq.copy_source is not None:
            self.manager.release([seq.copy_source])
            seq.copy_source = None


def _result(seq: Sequence) -> Snapshot | None:
    assert seq.loading is not None
    try:
        return seq.loading.result()
    except Exception:  # an unreadable snapshot is a miss: the prompt is computed
        return None
