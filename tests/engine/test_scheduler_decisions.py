"""The scheduler's decisions, with no model and no pool: block books and a stand-in for the tiers only.

What runs and what waits (reservations, first come first served, a shared prefill's followers), what
an admission reuses (published blocks, a partial block, a snapshot to read and then restore), how many
blocks a pass takes beyond the free ones (what idle sessions are copied down for), and what a step
computes (decode rows, then prefill chunks within the budget).
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import torch

from server.engine.config import EngineConfig
from server.engine.request import GenerationRequest, SamplingParams
from server.engine.scheduler import MIN_PREFILL_CHUNK, SOLO_PREFILL_FACTOR, Row, Scheduler
from server.engine.sequence import Sequence, SequenceStatus
from server.kv.blocks import BlockManager
from server.kv.pool import KVLayout
from server.kv.snapshot import Snapshot
from server.sessions.record import SessionKey

BLOCK = 4
SAMPLED = 7  # the token a step "samples": what the loop would append
# What a Sequence reads of a loaded model: its sampler's vocabulary and device, the detokenizer's tokenizer (used
# only to decode sampled text, which these tests never do), the end-of-sequence ids and the context limit.
LOADED = SimpleNamespace(vocab_size=16, device=torch.device("cpu"), tokenizer=None, eos_ids=[], max_context=4096)


class Tiers:
    """The scheduler's view of the tiers below the pool: which sessions they may hold more of, which K/V fits."""

    def __init__(self, held: dict[SessionKey, int] | None = None, digests: str = "fp") -> None:
        self.held, self.digests = held or {}, digests

    def fits(self, snapshot: Snapshot) -> bool:
        return snapshot.digests == self.digests

    def can_restore(self, key: SessionKey, num_in_pool: int) -> bool:
        return self.held.get(key, 0) > num_in_pool


def scheduler(num_blocks: int = 64, tiers: Tiers | None = None, **config) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK), EngineConfig(0, BLOCK, **config), tiers or Tiers())


def sequence(rid: str, prompt, max_tokens: int = 4, tenant: str = "default", kv_source=None) -> Sequence:
    request = GenerationRequest(
        request_id=rid,
        prompt_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        tenant=tenant,
        kv_source=kv_source,
    )
    return Sequence(request, None, None, LOADED)  # type: ignore[arg-type]


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.add(seq)


def admitted(sched: Scheduler) -> list[str]:
    return [a.seq.request.request_id for a in sched.admit().admissions]


def step(sched: Scheduler) -> list[tuple[str, int, bool]]:
    """One step as the loop takes it, the forward pass aside: plan, commit, append each sampled token."""
    rows = sched.schedule()
    sched.commit(rows)
    for row in rows:
        if row.is_sampled:
            row.seq.token_ids.append(SAMPLED)
    return plan(rows)


def plan(rows: list[Row]) -> list[tuple[str, int, bool]]:
    return [(r.seq.request.request_id, len(r.token_ids), r.is_sampled) for r in rows]


def prefilled(sched: Scheduler, *seqs: Sequence) -> None:
    while not all(s.is_prefilled for s in seqs):
        step(sched)


# -- reservations -----------------------------------------------------------------------------------
def test_admission_reserves_blocks_first_come_first_served_and_stops_at_the_first_that_cannot():
    sched = scheduler(num_blocks=10)
    a, b = sequence("a", range(0, 8), max_tokens=8), sequence("b", range(20, 28), max_tokens=8)  # 4 blocks each
    c, d = sequence("c", range(40, 52), max_tokens=8), sequence("d", [60, 61], max_tokens=2)  # 5 blocks, 1 block
    add(sched, a, b, c, d)
    assert admitted(sched) == ["a", "b"]  # d's 1 block would fit in the 2 left, but c came first
    assert (a.num_reserved, b.num_reserved, sched.manager.num_reserved) == (4, 4, 8)
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, d]
    assert [s.status for s in (a, b, c, d)] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING] * 2
    assert sched.remove(a)  # its reservation comes back: c, then d
    assert sched.manager.num_reserved == 4
    assert admitted(sched) == ["c", "d"]
    assert (c.num_reserved, d.num_reserved, sched.manager.num_reserved) == (5, 1, 10)


def test_blocks_a_prompt_shares_are_not_reserved_again():
    sched = scheduler(num_blocks=8)
    first = sequence("first", range(12), max_tokens=4)  # 16 slots: 4 blocks
    add(sched, first)
    admitted(sched)
    prefilled(sched, first)
    # 24 slots take 6 blocks, less the 2 full ones it shares: 4, which fit next to first's 4
    second = sequence("second", [*range(8), 50, 51, 52, 53], max_tokens=12)
    add(sched, second)
    assert admitted(sched) == ["second"]
    assert second.num_reserved == 4
    assert second.blocks == first.blocks[:2]
    assert [b.ref_count for b in first.blocks[:3]] == [2, 2, 1]  # pinned by both; first's third is first's alone


# -- prefix match ----------------------------------------------------------------------------------
def test_a_prompt_shares_the_published_full_blocks_and_copies_a_partial_one():
    sched = scheduler()
    a = sequence("a", range(10), max_tokens=2)
    add(sched, a)
    admitted(sched)
    prefilled(sched, a)  # published: [0-3] [4-7] and a partial [8, 9]
    b = sequence("b", [*range(9), 99, 100, 101], max_tokens=4)
    other = sequence("other", [*range(9), 99, 100, 101], max_tokens=4, tenant="another")
    add(sched, b, other)
    plan = sched.admit()
    admission, apart = plan.admissions
    assert admission.seq is b
    assert admission.shared == tuple(a.blocks[:2])
    assert admission.partial is a.blocks[2]
    assert admission.num_partial == 1  # [8] of [8, 9]; the prompt goes on with 99
    assert (admission.num_cached, admission.source) == (9, "device")
    assert admission.restore is None
    assert (b.blocks, b.copy_source, b.num_reserved) == (a.blocks[:2], a.blocks[2], 4 - 2)
    assert [blk.ref_count for blk in a.blocks] == [2, 2, 2]  # shared pinned; the copy source until it is copied
    assert (apart.seq, apart.shared, apart.partial, apart.num_cached, apart.source) == (other, (), None, 0, "none")

    # The bookkeeping of the copy: one new block from b's reservation, published with b's token once written
    [block] = sched.blocks_to_fill(admission)
    assert b.blocks == [*a.blocks[:2], block]
    assert b.num_reserved == 1
    sched.publish_filled(admission)
    assert b.num_computed == 9
    assert (block.token_ids, block.parent_hash) == ([8], a.blocks[1].hash)
    sched.unpin_copy_source(b)
    assert a.blocks[2].ref_count == 1


def test_the_last_prompt_token_is_never_taken_from_the_pool():
    sched = scheduler()
    a = sequence("a", range(8), max_tokens=2)
    add(sched, a)
    admitted(sched)
    prefilled(sched, a)  # [0-3] [4-7] published whole
    again = sequence("again", range(8), max_tokens=2)
    add(sched, again)
    [admission] = sched.admit().admissions
    assert admission.shared == (a.blocks[0],)
    assert (admission.partial, admission.num_partial, admission.num_cached) == (a.blocks[1], 3, 7)


# -- waiting for a shared prefill ----------------------------------------------------------------------
def test_a_prompt_waits_for_the_blocks_a_running_prefill_of_its_tenant_computes():
    sched = scheduler(max_batch_tokens=4)  # nothing decodes: 16-token chunks
    system = list(range(100, 124))  # 6 blocks
    leader = sequence("leader", [*system, 1, 2])
    follower = sequence("follower", [*system, 7, 8, 9])
    unrelated = sequence("unrelated", range(200, 210))
    other_tenant = sequence("other-tenant", [*system, 7, 8, 9], tenant="another")
    one_block = sequence("one-block", [*system[:4], 55, 56, 57, 58, 59])  # shares 1 block: not worth a wait
    add(sched, leader, follower, unrelated, other_tenant, one_block)
    assert admitted(sched) == ["leader", "unrelated", "other-tenant", "one-block"]
    assert list(sched.waiting) == [follower]
    assert follower.status is SequenceStatus.WAITING

    assert step(sched) == [("leader", 16, False)]  # 4 of its 6 blocks are published
    assert admitted(sched) == []  # the other 2 are still to come
    step(sched)
    assert leader.is_prefilled
    [admission] = sched.admit().admissions
    assert admission.seq is follower
    assert admission.shared == tuple(leader.blocks[:6])
    assert admission.num_cached == 24


def test_blocks_the_pool_holds_already_are_shared_at_once_behind_a_leader():
    sched = scheduler(max_batch_tokens=4)
    system = list(range(100, 124))
    opener = sequence("opener", [*system, 1])
    add(sched, opener)
    admitted(sched)
    prefilled(sched, opener)
    cached = opener.blocks[:6]
    sched.remove(opener)  # its blocks stay cached
    leader, follower = sequence("leader", [*system, 3, 4]), sequence("follower", [*system, 5, 6])
    add(sched, leader, follower)
    # The leader found the system prompt cached (num_computed still 0): nothing is left to wait for
    assert admitted(sched) == ["leader", "follower"]
    assert follower.blocks == leader.blocks == cached


# -- restore plans ---------------------------------------------------------------------------------
def loaded(seq: Sequence, snapshot: Snapshot | None) -> None:
    """The loader thread read the sequence's snapshot (None: nothing usable)."""
    assert seq.status is SequenceStatus.LOADING
    seq.loading = Future()
    seq.loading.set_result(snapshot)


def snapshot(key: SessionKey, token_ids, digests: str = "fp", origin: str = "disk") -> Snapshot:
    layout = KVLayout(1, 1, 1, torch.float32)  # its tensors are never read here
    return Snapshot(key, "m", layout, digests, list(token_ids), [], [], origin=origin)


def test_a_snapshot_the_tiers_may_hold_is_read_first_then_restored():
    key = SessionKey("default", "s")
    sched = scheduler(tiers=Tiers({key: 20}))
    prompt = list(range(40, 54))  # 14 tokens
    seq = sequence("s", prompt, max_tokens=2, kv_source=key)
    add(sched, seq)
    [admission] = sched.admit().admissions
    assert admission.load == key
    assert (seq.status, sched.loading, seq.num_reserved, sched.manager.num_reserved) == (
        SequenceStatus.LOADING,
        [seq],
        0,
        0,
    )
    assert sched.admit().admissions == []  # still being read

    loaded(seq, snapshot(key, [*prompt[:10], 999, 998]))
    [admission] = sched.admit().admissions
    assert admission.restore is seq.snapshot is not None
    assert (admission.load, admission.shared, admission.num_restore) == (None, (), 10)
    assert (admission.num_cached, admission.source) == (10, "disk")
    assert seq.num_reserved == 4  # 16 slots
    assert sched.running == [seq]

    # Bookkeeping: 3 blocks from the reservation, one run, published once written
    blocks = sched.blocks_to_fill(admission)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert seq.num_reserved == 1
    sched.publish_filled(admission)
    assert seq.num_computed == 10
    match = sched.manager.match("default", prompt, 13)
    assert (match.shared, match.partial, match.num_partial) == (blocks[:2], blocks[2], 2)


def test_a_restore_past_the_pool_keeps_the_shared_blocks_it_covers():
    key = SessionKey("default", "s")
    sched = scheduler(tiers=Tiers({key: 20}))
    prompt = list(range(40, 54))
    cached = sequence("cached", [*prompt[:5], 77])
    add(sched, cached)
    admitted(sched)
    prefilled(sched, cached)  # the pool holds 5 tokens of the prompt: one full block and one of a partial block
    seq = sequence("s", prompt, max_tokens=2, kv_source=key)
    add(sched, seq)
    assert sched.admit().admissions[0].load == key
    loaded(seq, snapshot(key, prompt, origin="host"))
    [admission] = sched.admit().admissions
    assert (admission.shared, admission.partial, admission.num_restore) == ((cached.blocks[0],), None, 13)
    assert (admission.num_cached, admission.source) == (13, "host")
    assert seq.copy_source is None  # the partial block is not copied: the snapshot gives its tokens
    assert len(sched.blocks_to_fill(admission)) == 3  # tokens 4..12 past the shared block


def test_a_snapshot_of_another_model_or_no_longer_than_the_pool_is_not_restored():
    key = SessionKey("default", "s")
    prompt = list(range(40, 54))
    sched = scheduler(tiers=Tiers({key: 20}))
    seq = sequence("s", prompt, kv_source=key)
    add(sched, seq)
    sched.admit()
    loaded(seq, snapshot(key, prompt, digests="another model"))
    [admission] = sched.admit().admissions
    assert (admission.load, admission.restore, admission.num_cached, admission.source) == (None, None, 0, "none")

    sched = scheduler(tiers=Tiers({key: 20}))
    cached = sequence("cached", prompt[:9])
    add(sched, cached)
    admitted(sched)
    prefilled(sched, cached)  # the pool holds 9 tokens
    seq = sequence("s", prompt, kv_source=key)
    add(sched, seq)
    sched.admit()
    loaded(seq, snapshot(key, prompt[:9]))
    [admission] = sched.admit().admissions
    assert admission.restore is None
    assert admission.shared == tuple(cached.blocks[:2])
    assert (admission.partial, admission.num_cached) == (cached.blocks[2], 9)


def test_tiers_holding_no_more_than_the_pool_are_not_read():
    key = SessionKey("default", "s")
    sched = scheduler(tiers=Tiers({key: 6}))
    cached = sequence("cached", range(40, 46))
    add(sched, cached)
    admitted(sched)
    prefilled(sched, cached)  # the pool holds 6 tokens of the prompt, as many as the tiers
    seq = sequence("s", range(40, 54), kv_source=key)
    add(sched, seq)
    [admission] = sched.admit().admissions
    assert (admission.load, admission.num_cached, seq.status) == (None, 6, SequenceStatus.RUNNING)


def test_blocks_a_failed_restore_took_go_back_to_the_reservation():
    key = SessionKey("default", "s")
    sched = scheduler(num_blocks=8, tiers=Tiers({key: 20}))
    prompt = list(range(40, 54))
    seq = sequence("s", prompt, max_tokens=2, kv_source=key)
    add(sched, seq)
    sched.admit()
    loaded(seq, snapshot(key, prompt))
    [admission] = sched.admit().admissions
    sched.blocks_to_fill(admission)
    assert (seq.num_reserved, sched.manager.num_free) == (0, 4)
    sched.unfill(admission)
    assert (seq.blocks, seq.num_reserved, sched.manager.num_reserved) == ([], 4, 4)
    assert (sched.manager.num_free, sched.manager.num_cached_idle) == (8, 0)  # their contents forgotten
    assert sched.manager.match("default", prompt, 13).num_tokens == 0  # nothing was published


# -- the blocks a pass takes beyond the free ones ------------------------------------------------------------
def test_the_pass_says_how_many_reserved_blocks_the_free_ones_lack():
    sched = scheduler(num_blocks=8)
    idle = sequence("idle", range(12), max_tokens=4)
    add(sched, idle)
    admitted(sched)
    prefilled(sched, idle)
    sched.remove(idle)  # 3 blocks cached, 5 free
    assert (sched.manager.num_free, sched.manager.num_cached_idle) == (5, 3)

    a, b = sequence("a", range(20, 24), max_tokens=4), sequence("b", range(30, 38), max_tokens=4)  # 2, 3 blocks
    add(sched, a, b)
    plan = sched.admit()
    assert (len(plan.admissions), plan.num_short) == (2, 0)  # the free ones are enough

    c = sequence("c", range(40, 44), max_tokens=4)  # 2 blocks: the free ones are promised, so cached ones
    d = sequence("d", range(50, 62), max_tokens=4)  # 4 more cannot be reserved, but were asked for
    add(sched, c, d)
    plan = sched.admit()
    assert [x.seq for x in plan.admissions] == [c]
    assert plan.num_short == 4 - (5 - 7)


def test_a_pass_taking_cached_blocks_says_how_many():
    sched = scheduler(num_blocks=8)
    idle = sequence("idle", range(12), max_tokens=4)
    add(sched, idle)
    admitted(sched)
    prefilled(sched, idle)
    sched.remove(idle)
    a = sequence("a", range(20, 40), max_tokens=4)  # 6 blocks: 5 free ones and 1 cached
    add(sched, a)
    plan = sched.admit()
    assert ([x.seq for x in plan.admissions], plan.num_short) == ([a], 1)


# -- chunk plans ---------------------------------------------------------------------------------
def test_a_step_feeds_decode_tokens_first_then_prefill_chunks_in_arrival_order():
    sched = scheduler(num_blocks=256, max_batch_tokens=32)
    d = sequence("d", range(500, 504))
    add(sched, d)
    admitted(sched)
    assert step(sched) == [("d", 4, True)]
    p1, p2 = sequence("p1", range(1000, 1020)), sequence("p2", range(2000, 2040))
    add(sched, p1, p2)
    admitted(sched)
    # 32 tokens: d's decode token, then p1 whole (sampled: its last chunk), then what is left for p2
    assert step(sched) == [("d", 1, True), ("p1", 20, True), ("p2", 11, False)]
    assert (len(p1.blocks), len(p2.blocks)) == (5, 3)  # slots allocated for what the step computes
    assert step(sched) == [("d", 1, True), ("p1", 1, True), ("p2", 29, True)]
    assert (p2.num_computed, len(p2.blocks)) == (40, 10)


def test_with_nothing_decoding_a_prefill_chunk_may_be_larger():
    sched = scheduler(num_blocks=256, max_batch_tokens=8)
    a, b = sequence("a", range(100, 140)), sequence("b", range(200, 210))
    add(sched, a, b)
    admitted(sched)
    assert step(sched) == [("a", 8 * SOLO_PREFILL_FACTOR, False)]
    assert step(sched) == [("a", 8, True), ("b", 10, True)]  # nothing decoded when this step was planned


def test_admitted_prompts_keep_moving_however_many_streams_decode():
    sched = scheduler(num_blocks=256, max_batch_tokens=4)
    streams = [sequence(f"d{i}", range(10 * i, 10 * i + 3)) for i in range(3)]
    add(sched, *streams)
    admitted(sched)
    prefilled(sched, *streams)
    p = sequence("p", range(300, 340))
    add(sched, p)
    admitted(sched)
    assert step(sched) == [("d0", 1, True), ("d1", 1, True), ("d2", 1, True), ("p", MIN_PREFILL_CHUNK, False)]


def test_a_prefill_only_request_samples_nothing():
    sched = scheduler(max_batch_tokens=4)
    seq = sequence("system", range(6), max_tokens=0)
    add(sched, seq)
    admitted(sched)
    assert step(sched) == [("system", 6, False)]
    assert seq.is_prefilled
