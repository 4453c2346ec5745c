"""Moving sessions' K/V between the paged pool and the host/disk tiers (on the engine thread).

Down: the blocks holding a transcript's prefix are gathered into per-layer tensors
[kv_heads, tokens, row] on the host (pinned, asynchronous on CUDA), as many as admission
says its reservations take beyond the free blocks, before they are allocated. A tier set to keep
fewer bits than the pool (`TierFormats`) gets them quantized on the device, before the copy. Up
(`restore`, which the model runner calls): a snapshot's tokens are written into blocks the
scheduler took from the request's reservation, converted back to the pool's format on the device;
the scheduler then publishes them under their prefix hashes, so the request that restored them,
and any later one, finds them like computed blocks.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import cached_property

from server.kv.block_store import WriteJob, addresses
from server.kv.blocks import BlockManager
from server.kv.pool import KVLayout, KVPool
from server.kv.snapshot import Snapshot
from server.kv.tiers import TierStore
from server.sessions.record import SessionKey
from server.sessions.store import SessionStore

log = logging.getLogger("kvserve.engine")
MAX_PENDING_BYTES = 1 << 30  # at shutdown, snapshots waiting for the disk writer


def restore(pool: KVPool, block_ids: list[int], snapshot: Snapshot, first: int, num_tokens: int) -> None:
    """Write the snapshot's tokens `first`..`num_tokens`-1 into these blocks (the first of them holds token
    `first`, a block boundary). A snapshot already copied to the device (`upload`): the compute stream waits for
    that copy, the engine thread does not."""
    if snapshot.uploaded is not None:
        pool.transfers.use_on_compute(snapshot.uploaded, snapshot.k + snapshot.v)
    else:
        snapshot.wait()
    slots = pool.slots(block_ids, num_tokens - first)
    k, v = [k[:, first:num_tokens] for k in snapshot.k], [v[:, first:num_tokens] for v in snapshot.v]
    pool.scatter(slots, k, v, snapshot.layout)  # converted to the pool's format where a tier keeps fewer bits


class Offloader:
    """Which sessions' K/V leave the pool for the tiers, and when."""

    def __init__(
        self, pool: KVPool, manager: BlockManager, store: SessionStore, tiers: TierStore, model_id: str, digests: str
    ) -> None:
        """`digests`: the model's (`ModelDigests.text`): with a layout, the K/V fingerprint of each stored form."""
        if tiers.block_size != manager.block_size:  # blocks below the pool are addressed by the pool's blocks
            raise ValueError(f"the tiers' block size {tiers.block_size} differs from the pool's {manager.block_size}")
        self.pool, self.manager, self.store, self.tiers = pool, manager, store, tiers
        self.model_id, self.digests = model_id, digests
        self.num_spilled = 0

    @cached_property
    def layouts(self) -> dict[str, KVLayout]:
        """How each tier keeps this pool's K/V."""
        return self.tiers.formats.layouts(self.pool.layout)

    @cached_property
    def shared_fingerprint(self) -> str:
        """The K/V fingerprint this replica's blocks in Redis are addressed by: of the form the shared tier keeps them
        in, which is not the pool's where that tier keeps fewer bits (`KVSERVE_SHARED_KV_DTYPE`)."""
        return self.layouts["shared"].fingerprint(self.digests)

    def fits(self, snapshot: Snapshot) -> bool:
        """A snapshot this pool can restore: this model's K/V, computed as the pool computes it (its stored form
        may differ: it is converted)."""
        return snapshot.digests == self.digests and snapshot.layout.computed == self.pool.layout.computed

    def gather(self, key: SessionKey, token_ids: list[int]) -> Snapshot | None:
        """A host copy of the K/V the pool holds for a prefix of `token_ids` (None when it holds none)."""
        blocks, num_tokens = self.manager.chain(key.tenant, token_ids)
        if num_tokens == 0:
            return None
        layout = self.layouts["host"]
        k, v = self.pool.gather(self.pool.slots([b.block_id for b in blocks], num_tokens), layout)
        hosts, ready = self.pool.transfers.to_host(k + v)  # on CUDA: pinned, on the side stream
        k, v = hosts[: len(k)], hosts[len(k) :]
        ids = list(token_ids[:num_tokens])
        return Snapshot(key, self.model_id, layout, self.digests, ids, k, v, ready=ready)

    def spill(self, num_short: int) -> None:
        """Before the pool evicts cached blocks (`num_short`: how many reserved blocks the free ones lack), copy
        idle sessions' K/V down a tier, least recently used first, until those copied hold that many idle blocks."""
        deficit = num_short
        if deficit <= 0 or not self.tiers.is_enabled:
            return
        for key, token_ids in self.store.idle_transcripts(self.model_id):
            blocks, num_tokens = self.manager.chain(key.tenant, token_ids)
            if blocks and not self.tiers.covers(key, token_ids[:num_tokens]):  # never replace a longer copy
                self.save(key, token_ids)
            deficit -= sum(1 for b in blocks if b.ref_count == 0)
            if deficit <= 0:
                return

    def discard_forgotten(self) -> None:
        """Deleted or expired sessions' K/V leaves the pool too, but for what another session still reaches."""
        for key, token_ids in self.store.take_forgotten(self.model_id):
            self.forget(key, token_ids)

    def forget(self, key: SessionKey, token_ids: list[int]) -> None:
        """Drop the pool blocks only `key`'s transcript reaches: all but the full blocks within the prefix another
        session shares (ones a running sequence holds stay: the engine forgets a deleted session's blocks again
        when its request finishes)."""
        reach = self.store.reach(key, self.model_id, token_ids)
        blocks, _ = self.manager.chain(key.tenant, token_ids, own=True)
        kept, rest = reach.num_blocks(len(blocks), self.manager.block_size), reach.num_tokens % self.manager.block_size
        if reach.other_ends and not reach.is_covered and rest and 0 < kept <= len(blocks):
            self.manager.trim(blocks[kept - 1], rest)  # the other ends inside this block: the rest was ours
        self.manager.discard(blocks[kept:])

    def save_all(self) -> int:
        """At shutdown: every idle session's K/V the pool holds goes down a tier. Returns how many."""
        saved = 0
        for key, token_ids in self.store.idle_transcripts(self.model_id):
            num_tokens = self.manager.chain(key.tenant, token_ids)[1]
            if num_tokens and not self.tiers.covers(key, token_ids[:num_tokens]):
                saved += self.save(key, token_ids)
            if self.tiers.pending_bytes() > MAX_PENDING_BYTES:
                self.tiers.flush_pending()  # a large pool is not copied into host RAM all at once
        return saved

    # -- the shared tier (Redis) ------------------------------------------------------------
    def share(self, key: SessionKey, token_ids: list[int]) -> None:
        """Behind a completed turn: copy the transcript's full blocks Redis is not known to hold, for the writer
        thread to store. Best effort: a block not shared is only recomputed by another replica."""
        shared = self.tiers.shared
        if shared is None or key.is_bucket:
            return
        try:
            blocks, num_tokens = self.manager.chain(key.tenant, token_ids)
            bs, layout = self.manager.block_size, self.layouts["shared"]
            full = token_ids[: num_tokens - num_tokens % bs]
            names = addresses(self.shared_fingerprint, bs, key.tenant, full)
            new = shared.unknown(names)
            if not new:
                return
            k, v = self.pool.gather(self.pool.slots([blocks[i].block_id for i in new], len(new) * bs), layout)
            hosts, event = self.pool.transfers.to_host(k + v)  # on CUDA: the side stream, pinned
            job = WriteJob([names[i] for i in new], hosts[: len(k)], hosts[len(k) :], bs)  # block j: tokens j*bs ..
            if event is not None:
                job.ready = event.synchronize  # the writer thread waits for the copy, not the engine
            shared.put(job)
        except Exception:
            log.exception("sharing the K/V of session %s failed; other replicas recompute it", key.name)

    def can_restore(self, key: SessionKey, num_in_pool: int) -> bool:
        """Some tier below the pool may hold more of `key`'s transcript than the pool matched."""
        if self.tiers.peek_tokens(key) > num_in_pool:
            return True
        if self.tiers.shared is None:
            return False
        bs = self.manager.block_size
        return len(self.store.transcript(key)) // bs * bs > num_in_pool

    def fetch(self, key: SessionKey, prompt_ids: list[int]) -> Snapshot | None:
        """On the loader thread: the session's snapshot in host RAM, else the leading blocks of its prompt that
        the block store holds (disk, then Redis; checked)."""
        snapshot = self.tiers.fetch(key, self.model_id, self.digests, self.pool.layout)
        if snapshot is None:
            usable = prompt_ids[: len(prompt_ids) - 1]  # the last prompt token is always computed, for its logits
            snapshot = self.tiers.read(key, usable, self.model_id, self.digests, self.pool.layout)
        return None if snapshot is None else self.upload(snapshot)

    def upload(self, snapshot: Snapshot) -> Snapshot:
        """On the loader thread, for a CUDA pool: a copy of the snapshot on the device, made on the side stream
        through pinned memory, for the restore to use without waiting (the tier's own snapshot is left as it is).
        Without CUDA the snapshot itself."""
        transfers = self.pool.transfers
        if transfers.ops is None:
            return snapshot
        # A snapshot spilled to host RAM and asked for again before anyone waited for its copy down: that copy may
        # be in flight. The copy up below runs on the same side stream, after it, so the device would order the
        # two anyway; the wait keeps the rule that whoever reads a snapshot's host tensors waits for its event
        # (transfers.py), whatever stream reads them. It blocks this loader thread, never the engine's.
        snapshot.wait()
        tensors, staged, event = transfers.to_device(snapshot.k + snapshot.v)
        n = len(snapshot.k)
        return replace(snapshot, k=tensors[:n], v=tensors[n:], ready=None, uploaded=event, staged=staged)

    def save(self, key: SessionKey, token_ids: list[int]) -> bool:
        """Best effort: a session whose copy fails (e.g. out of memory) just recomputes later."""
        try:
            snapshot = self.gather(key, token_ids)
            if snapshot is None:
                return False
            self.tiers.put(snapshot)
        except Exception:
            log.exception("copying the K/V of session %s down a tier failed", key.name)
            return False
        if not self.store.is_live(key):
            self.tiers.drop(key)  # deleted while it was copied
            return False
        self.num_spilled += 1
        return True
