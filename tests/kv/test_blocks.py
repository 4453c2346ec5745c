"""Block manager bookkeeping without tensors: sharing, partial matches, eviction order, stale heap, collisions."""

from __future__ import annotations

from server.kv import blocks as bm
from server.kv.blocks import BlockManager
from server.kv.offload import Offloader
from server.kv.tiers import TierStore
from server.sessions.record import CompletedTurn, SessionKey, Usage
from server.sessions.store import SessionStore


def fill(manager: BlockManager, salt: str, ids: list[int]) -> list:
    """Allocate and record blocks for `ids` as an engine would after a forward pass."""
    blocks, parent = [], manager.root(salt)
    for start in range(0, len(ids), manager.block_size):
        manager.reserve(1)
        block = manager.allocate(blocks[-1].block_id + 1 if blocks else None)
        manager.record(block, parent, ids[start : start + manager.block_size])
        blocks.append(block)
        parent = block.hash
    return blocks


def test_full_blocks_shared_partial_copied_tenants_apart():
    manager = BlockManager(16, 4)
    owner = fill(manager, "t", list(range(10)))  # blocks [0-3] [4-7] [8,9]
    match = manager.match("t", [*list(range(10)), 99], 10)
    assert match.shared == owner[:2]
    assert match.partial is owner[2]
    assert match.num_partial == 2
    edited = manager.match("t", [0, 1, 2, 3, 4, 5, 77, 78], 8)
    assert edited.shared == owner[:1]
    assert edited.partial is owner[1]
    assert edited.num_partial == 2
    assert manager.match("other-tenant", list(range(10)), 10).num_tokens == 0


def test_release_tail_first_and_counters_return_to_zero():
    manager = BlockManager(4, 2)
    blocks = fill(manager, "t", [1, 2, 3, 4, 5, 6])
    assert manager.num_used == 3
    manager.release(blocks)
    assert manager.num_used == 0
    assert manager.num_cached_idle == 3
    assert manager.num_reserved == 0
    manager.reserve(2)
    manager.allocate()  # the free block
    manager.allocate()  # evicts the least recently used: the tail block
    assert manager.match("t", [1, 2, 3, 4, 5, 6], 6).num_tokens == 4


def test_free_heap_stays_bounded_when_preferred_ids_are_reused():
    manager = BlockManager(8, 2)
    for _ in range(500):
        blocks = fill(manager, "t", list(range(8)))
        manager.release(blocks, keep_contents=False)
    assert len(manager._free_heap) <= 2 * manager.num_blocks + 1
    assert manager.num_free == 8
    assert manager.num_reserved == 0


def test_a_hash_collision_never_serves_other_tokens(monkeypatch):
    manager = BlockManager(8, 2)
    monkeypatch.setattr(bm, "chain_hash", lambda parent, ids: 42)  # every block collides
    fill(manager, "t", [1, 2])
    match = manager.match("t", [7, 8, 9], 2)
    assert match.shared == []
    assert match.num_tokens == 0


def test_a_shared_block_released_by_one_holder_stays_with_the_other():
    manager = BlockManager(8, 2)
    first = fill(manager, "t", [1, 2, 3, 4])
    manager.release(first)  # idle, cached
    second = manager.match("t", [1, 2, 3, 4, 5], 4).shared
    manager.pin(second)  # two running sequences share the prefix
    manager.pin(second)
    assert [b.ref_count for b in second] == [2, 2]
    manager.release(second)  # one of them finishes
    assert [b.ref_count for b in second] == [1, 1]  # dropped by one, not to zero
    assert manager.num_used == 2
    assert manager.num_cached_idle == 0  # still held, not evictable
    manager.reserve(6)
    for _ in range(6):
        manager.allocate()  # takes every free block; the held prefix is never handed out
    assert manager.match("t", [1, 2, 3, 4], 4).num_tokens == 4


def test_idle_cached_blocks_a_request_pins_are_not_counted_as_free():
    manager = BlockManager(10, 2)
    prefix = fill(manager, "t", [1, 2, 3, 4, 5, 6, 7, 8])  # 4 blocks
    manager.release(prefix)  # idle and cached: evictable for anyone else
    manager.reserve(3)  # another sequence's promise: 10 - 4 - 3 = 3 free blocks left
    assert manager.num_free == 6
    assert manager.num_cached_idle == 4
    assert manager.can_reserve(7, [])  # 6 free + 4 evictable - 3 promised
    assert not manager.can_reserve(4, prefix)  # it pins the 4 cached blocks: they cannot also make its room
    assert manager.can_reserve(3, prefix)


def test_trim_keeps_exactly_the_tokens_asked_for():
    manager = BlockManager(8, 4)
    blocks = fill(manager, "t", [1, 2, 3, 4, 5, 6, 7, 8])
    manager.release(blocks)
    manager.trim(blocks[1], 2)  # another transcript ends after 6: tokens 7 and 8 were someone else's
    assert blocks[1].token_ids == [5, 6]
    assert blocks[1].hash is None  # no longer a full block: never matched as one
    match = manager.match("t", [1, 2, 3, 4, 5, 6, 7, 8, 9], 8)
    assert (match.shared, match.partial, match.num_partial) == (blocks[:1], blocks[1], 2)
    manager.pin(blocks)
    manager.trim(blocks[0], 1)  # a block a running sequence holds is never cut
    assert blocks[0].token_ids == [1, 2, 3, 4]


def test_a_block_gets_a_new_stamp_for_each_new_contents_and_keeps_it_while_shared():
    """What was read from a block (a kernel layout of its keys) is current while the block keeps its stamp."""
    manager = BlockManager(4, 2)
    blocks = fill(manager, "t", [1, 2, 3, 4])
    first = [b.stamp for b in blocks]
    assert len(set(first)) == 2
    manager.pin(manager.match("t", [1, 2, 3, 4, 5], 4).shared)  # a second holder shares them as they are
    assert [b.stamp for b in blocks] == first
    manager.release(blocks)
    manager.release(blocks)
    manager.trim(blocks[1], 1)  # cut: slot 1 may take other K/V later
    cut = blocks[1].stamp
    assert cut not in first
    assert manager.discard(blocks) == 2  # contents nobody holds: the blocks are free
    again = fill(manager, "t", [9, 8, 7, 6])  # the same blocks (lowest ids first), other tokens
    assert [b.block_id for b in again] == [b.block_id for b in blocks]
    assert not {b.stamp for b in again} & {*first, cut}


def test_a_deleted_sessions_block_another_transcript_ends_inside_keeps_only_the_others_part():
    manager, store = BlockManager(16, 4), SessionStore(ttl_s=3600)
    kept, gone = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    for name, ids in (("kept", kept), ("gone", gone)):
        store.release(
            store.acquire(SessionKey("default", name), "m"), CompletedTurn(ids, "", "stop", Usage(6, 0, 0), None)
        )
    blocks = fill(manager, "default", gone[:9])  # gone's K/V: [1..4] [5..8] [9]; kept ends inside the second
    manager.release(blocks)
    assert store.delete(SessionKey("default", "gone"))
    tiers = TierStore(0, 0, None, block_size=4)
    Offloader(None, manager, store, tiers, "m", "fp").discard_forgotten()  # type: ignore[arg-type]
    assert manager.match("default", [*kept, 0], 6).num_tokens == 6  # kept still finds all of its K/V
    assert manager.match("default", gone, 9).num_tokens == 6  # nothing the deleted session alone computed
    assert blocks[2].token_ids == []  # its last block, only its own, is free again
    assert manager.num_free == 16 - 2
