"""Paged KV bookkeeping (no tensors): blocks, reference counts, prefix hashes, LRU, reservations.

A block holds `block_size` token slots. Full blocks are identified by a chained hash
(parent hash, token ids), rooted in a per-tenant salt, so equal prefixes of one tenant map
to the same blocks and different tenants never share. Blocks with no reference keep their
contents as cache and are evicted least-recently-used when a free block is needed.
Partially filled blocks are cached too (under their parent hash) so a follow-up turn can
copy the matching part instead of recomputing it; a match that diverges inside a block
copies that block. Reservations make admission safe: a running sequence never runs out.
Only the engine thread that owns the pool changes its BlockManager, so it takes no lock. Other
threads may read it while it is at rest (`read`): a sequence lock, not a mutex, so a reader never
waits for a forward pass and the engine thread never waits for a reader.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from server.sessions.index import Reach
from server.sessions.record import common_prefix_len

_STAMPS = itertools.count(1)  # one sequence for the process: no two contents of any block share a stamp


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    parent_hash: int | None = None  # chain position; None while the block holds nothing reusable
    token_ids: list[int] = field(default_factory=list)
    hash: int | None = None  # set once full and registered
    # Which contents the block holds: a new number each time it is handed out for new contents or cut, so what
    # was read from it (a kernel layout of its keys, server/kv/head_layouts.py) is known to be current.
    stamp: int = 0


@dataclass(slots=True)
class Match:
    """What a prompt can reuse: whole blocks to share, then a block to copy the first `num_partial` slots of."""

    shared: list[Block]
    partial: Block | None
    num_partial: int

    @property
    def num_tokens(self) -> int:
        return sum(len(b.token_ids) for b in self.shared) + self.num_partial


@dataclass(slots=True, frozen=True)
class Residency:
    """A transcript's K/V in the pool: how many tokens, in how many blocks only it reaches and how many shared."""

    num_tokens: int
    num_exclusive: int
    num_shared: int


def chain_hash(parent: int, token_ids: list[int] | tuple[int, ...]) -> int:
    return hash((parent, tuple(token_ids)))


T = TypeVar("T")


class BooksBusy(Exception):
    """The books did not come to rest for long enough to read them within the deadline."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # made on first use: a pool of a small model has hundreds of thousands of blocks (4 GiB of a test model: half a
        # million, two seconds of every start to make them all up front)
        self._blocks: dict[int, Block] = {}
        self._free_heap = list(range(num_blocks))  # lowest id first: neighbours stay contiguous
        self._free = set(self._free_heap)
        self._by_hash: dict[int, Block] = {}
        self._children: dict[int, dict[int, Block]] = {}  # parent hash -> cached blocks under it
        self._lru: OrderedDict[int, Block] = OrderedDict()  # unreferenced blocks with contents
        self.num_reserved = 0
        self.num_evictions = 0
        # Even while the books are at rest (the engine thread waits for work, or runs a forward pass, which only
        # reads them), odd while the engine thread may be changing them: see `read`.
        self.epoch = 0

    # -- reading from another thread ------------------------------------------------
    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """The engine thread may change the books inside: readers elsewhere wait for it to end (or rest)."""
        assert self.epoch % 2 == 0, "the books are already being changed"
        self.epoch += 1
        try:
            yield
        finally:
            self.epoch += 1

    @contextlib.contextmanager
    def resting(self) -> Iterator[None]:
        """Inside `changing`: the engine thread leaves the books alone meanwhile (a forward pass)."""
        assert self.epoch % 2 == 1, "resting is a pause inside changing"
        self.epoch += 1
        try:
            yield
        finally:
            self.epoch += 1

    def read(self, fn: Callable[[], T], deadline_s: float, pause_s: float = 0.0005) -> T:
        """`fn()`, which only reads the books, run on the caller's thread as of a moment they were at rest.

        A sequence lock: the answer counts when the epoch was even before `fn` and unchanged after it, so no
        change began or ended meanwhile (the GIL makes each attribute read and each increment whole). Otherwise,
        or when `fn` tripped over a change in progress, it reads again. Raises BooksBusy past the deadline.
        """
        deadline = time.monotonic() + deadline_s
        while True:
            epoch = self.epoch
            if epoch % 2 == 0:
                try:
                    answer = fn()
                except Exception:
                    if self.epoch == epoch:
                        raise  # the books did not move: a real error, not a torn read
                else:
                    if self.epoch == epoch:
                        return answer
            if time.monotonic() > deadline:
                raise BooksBusy(f"the books were not at rest for {deadline_s:g} s")
            time.sleep(pause_s)

    # -- counters ---------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    @property
    def num_cached_idle(self) -> int:
        return len(self._lru)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def root(self, salt: str) -> int:
        return hash(("kvserve-prefix", salt))

    # -- lookup -----------------------------------------------------------------
    def match(self, salt: str, token_ids: list[int], max_tokens: int) -> Match:
        """The longest cached prefix of `token_ids`, at most `max_tokens` long."""
        bs, parent = self.block_size, self.root(salt)
        shared: list[Block] = []
        while len(shared) * bs + bs <= max_tokens:
            start = len(shared) * bs
            tokens = token_ids[start : start + bs]
            block = self._by_hash.get(chain_hash(parent, tokens))
            if block is None or block.hash is None or block.token_ids != tokens or block.parent_hash != parent:
                break  # a miss, or a hash collision: never serve K/V computed for other tokens
            shared.append(block)
            parent = block.hash
        start = len(shared) * bs
        want = token_ids[start : min(start + bs, max_tokens)]
        best, best_len = None, 0
        for block in self._children.get(parent, {}).values():
            n = common_prefix_len(block.token_ids, want)
            if n > best_len:
                best, best_len = block, n
        return Match(shared, best, best_len)

    # -- allocation ---------------------------------------------------------------
    def can_reserve(self, num_blocks: int, pinned: list[Block]) -> bool:
        idle_pinned = sum(1 for b in pinned if b.ref_count == 0)
        return num_blocks <= len(self._free) + len(self._lru) - idle_pinned - self.num_reserved

    def reserve(self, num_blocks: int) -> None:
        self.num_reserved += num_blocks

    def unreserve(self, num_blocks: int) -> None:
        self.num_reserved -= num_blocks

    def pin(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_count == 0:
                self._lru.pop(block.block_id, None)
            block.ref_count += 1

    def allocate(self, prefer: int | None = None) -> Block:
        """A block for new contents (from the reservation), next to `prefer` when that one is free."""
        if prefer is not None and prefer in self._free:
            self._free.discard(prefer)
            block_id = prefer
        elif self._free:
            block_id = heapq.heappop(self._free_heap)
            while block_id not in self._free:
                block_id = heapq.heappop(self._free_heap)
            self._free.discard(block_id)
        else:
            _, victim = self._lru.popitem(last=False)
            self._forget(victim)
            self.num_evictions += 1
            block_id = victim.block_id
        self.num_reserved -= 1
        block = self._blocks.get(block_id)
        if block is None:
            block = self._blocks[block_id] = Block(block_id)
        block.ref_count = 1
        block.stamp = next(_STAMPS)
        return block

    def record(self, block: Block, parent_hash: int, token_ids: list[int]) -> None:
        """Contents were written to `block` (its slots 0..len-1 now hold these tokens' K/V)."""
        if block.parent_hash is None:
            block.parent_hash = parent_hash
            self._children.setdefault(parent_hash, {})[block.block_id] = block
        block.token_ids = token_ids
        if len(token_ids) == self.block_size:
            block.hash = chain_hash(parent_hash, token_ids)
            self._by_hash.setdefault(block.hash, block)  # an equal block computed concurrently stays private

    def release(self, blocks: list[Block], keep_contents: bool = True) -> None:
        # Tail first: it becomes the least recently used, so eviction eats a sequence from its end
        # and the shared prefix, which every continuation needs, is the last to go.
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if keep_contents and block.token_ids:
                self._lru[block.block_id] = block  # newest at the end
            else:
                self._forget(block)
                self._push_free(block.block_id)

    def discard(self, blocks: list[Block]) -> int:
        """Drop cached contents nobody holds (a deleted session's K/V); returns how many blocks were freed."""
        freed = 0
        for block in blocks:
            if block.ref_count == 0 and self._lru.pop(block.block_id, None) is not None:
                self._forget(block)
                self._push_free(block.block_id)
                freed += 1
        return freed

    def trim(self, block: Block, num_tokens: int) -> None:
        """An idle cached block keeps only its first `num_tokens` tokens (the rest is never matched again)."""
        if block.ref_count or num_tokens >= len(block.token_ids):
            return
        if block.hash is not None and self._by_hash.get(block.hash) is block:
            del self._by_hash[block.hash]
        block.hash, block.token_ids = None, block.token_ids[:num_tokens]
        block.stamp = next(_STAMPS)

    def _push_free(self, block_id: int) -> None:
        self._free.add(block_id)
        heapq.heappush(self._free_heap, block_id)
        if len(self._free_heap) > 2 * self.num_blocks:  # ids taken as "preferred" leave stale entries behind
            self._free_heap = sorted(self._free)

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self._by_hash.get(block.hash) is block:
            del self._by_hash[block.hash]
        if block.parent_hash is not None:
            siblings = self._children.get(block.parent_hash, {})
            siblings.pop(block.block_id, None)
            if not siblings:
                self._children.pop(block.parent_hash, None)
        block.parent_hash, block.token_ids, block.hash = None, [], None

    def chain(self, salt: str, token_ids: list[int], own: bool = False) -> tuple[list[Block], int]:
        """The blocks holding the longest cached prefix of `token_ids`, and that prefix's length.

        `own`: a last, partially matching block that holds other tokens too (another transcript's) is left out.
        """
        match = self.match(salt, token_ids, len(token_ids))
        tail, start = match.partial, len(match.shared) * self.block_size
        if own and tail is not None and tail.token_ids != token_ids[start : start + len(tail.token_ids)]:
            tail = None
        return match.shared + ([tail] if tail is not None else []), match.num_tokens

    def residency(self, salt: str, token_ids: list[int], reach: Reach | None) -> Residency:
        """A block is shared when more than one running sequence holds it, or when another transcript of the
        tenant reaches it (`reach`: how much of `token_ids` one shares; None: not asked)."""
        blocks, num_tokens = self.chain(salt, token_ids)
        reached = reach.num_blocks(len(blocks), self.block_size) if reach is not None else 0
        num_shared = sum(1 for i, b in enumerate(blocks) if i < reached or b.ref_count > 1)
        return Residency(num_tokens, len(blocks) - num_shared, num_shared)
