"""Moving a session's K/V between the paged device pool and a host-side Snapshot.

Down: the blocks holding a transcript's prefix are gathered into per-layer tensors
[kv_heads, tokens, head_dim] on the host (pinned, asynchronous on CUDA). Up: a snapshot's
tokens are written into freshly allocated blocks and published under their prefix hashes,
so the request that restored them, and any later one, finds them like computed blocks.
"""

from __future__ import annotations

import logging

import torch

from server.engine.block_manager import Block, BlockManager
from server.engine.paged_attention import KVPool
from server.engine.snapshot import Snapshot
from server.engine.types import SessionKey

log = logging.getLogger("kvserve.engine")
MAX_PENDING_BYTES = 1 << 30  # at shutdown, snapshots waiting for the disk writer
MAX_SESSIONS_WALKED = 256  # above this, a delete leaves its blocks to the LRU instead of walking every session


def chain_blocks(manager: BlockManager, salt: str, token_ids: list[int]) -> tuple[list[Block], int]:
    """The pool blocks holding the longest cached prefix of `token_ids`, and that prefix's length."""
    match = manager.match(salt, token_ids, len(token_ids))
    blocks = match.shared + ([match.partial] if match.partial is not None else [])
    return blocks, match.num_tokens


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def gather(
    pool: KVPool, manager: BlockManager, key: SessionKey, token_ids: list[int], model_id: str, fingerprint: str
) -> Snapshot | None:
    """A host copy of the K/V the pool holds for a prefix of `token_ids` (None when it holds none)."""
    blocks, num_tokens = chain_blocks(manager, key.tenant, token_ids)
    if num_tokens == 0:
        return None
    bs = manager.block_size
    slots = [b.block_id * bs + offset for b in blocks for offset in range(bs)][:num_tokens]
    index = torch.tensor(slots, dtype=torch.long, device=pool.device)
    k = [_to_host(t.index_select(1, index)) for t in pool.k]  # [kv_heads, tokens, head_dim] each
    v = [_to_host(t.index_select(1, index)) for t in pool.v]
    ready = None
    if pool.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    return Snapshot(key, model_id, fingerprint, list(token_ids[:num_tokens]), k, v, ready=ready)


def restore(
    pool: KVPool, manager: BlockManager, salt: str, shared: list[Block], snapshot: Snapshot, num_tokens: int
) -> list[Block]:
    """Write the snapshot's tokens past `shared` (up to `num_tokens`) into new blocks taken from a reservation."""
    snapshot.wait()
    bs = manager.block_size
    parent = shared[-1].hash if shared else manager.root(salt)
    prefer = shared[-1].block_id + 1 if shared else None  # contiguous with the shared prefix when free
    first = len(shared) * bs
    restored: list[Block] = []
    for _start in range(first, num_tokens, bs):  # from the request's reservation
        restored.append(manager.allocate(prefer))
        prefer = restored[-1].block_id + 1
    try:
        slots = [b.block_id * bs + offset for b in restored for offset in range(bs)][: num_tokens - first]
        index = torch.tensor(slots, dtype=torch.long, device=pool.device)
        for pool_k, pool_v, k, v in zip(pool.k, pool.v, snapshot.k, snapshot.v, strict=True):
            # one copy per layer: [kv_heads, tokens, head_dim] into the blocks' slots
            pool_k.index_copy_(1, index, k[:, first:num_tokens].to(pool.device, non_blocking=True))
            pool_v.index_copy_(1, index, v[:, first:num_tokens].to(pool.device, non_blocking=True))
    except BaseException:
        manager.release(restored, keep_contents=False)  # nothing was published: no one can see these
        manager.reserve(len(restored))  # back to the request's reservation
        raise
    for block, start in zip(restored, range(first, num_tokens, bs), strict=True):  # published once written
        manager.record(block, parent, list(snapshot.token_ids[start : min(start + bs, num_tokens)]))
        parent = block.hash
    return restored


class Offloader:
    """Which sessions' K/V leave the pool for the tiers, and when (the engine thread's side)."""

    def __init__(self, pool: KVPool, manager: BlockManager, store, model_id: str, fingerprint: str) -> None:
        self.pool, self.manager, self.store = pool, manager, store
        self.model_id, self.fingerprint = model_id, fingerprint
        self.num_spilled = 0

    def spill(self, num_needed: int) -> None:
        """Before the pool evicts cached blocks, copy idle sessions' K/V down a tier, least recently used first."""
        tiers = self.store.tiers
        deficit = num_needed - (self.manager.num_free - self.manager.num_reserved)
        if deficit <= 0 or not tiers.is_enabled:
            return
        for key, token_ids in self.store.idle_transcripts(self.model_id):
            blocks, num_tokens = chain_blocks(self.manager, key.tenant, token_ids)
            if blocks and not tiers.covers(key, token_ids[:num_tokens]):  # never replace a longer copy
                self.save(key, token_ids)
            deficit -= sum(1 for b in blocks if b.ref_count == 0)
            if deficit <= 0:
                return

    def discard_forgotten(self) -> None:
        """A deleted or expired session's K/V leaves the pool too, unless another session reaches it.

        Runs on the engine thread, the pool's only writer, so the walk needs no lock; it is skipped
        for tenants with very many sessions (the blocks are unreferenced and the LRU reclaims them).
        """
        by_tenant: dict[str, list[list[int]]] = {}
        for key, token_ids in self.store.take_forgotten(self.model_id):
            by_tenant.setdefault(key.tenant, []).append(token_ids)
        for tenant, transcripts in by_tenant.items():
            others = self.store.others(SessionKey(tenant, ""), self.model_id)
            if len(others) > MAX_SESSIONS_WALKED:
                continue
            kept = {b.block_id for ids in others for b in chain_blocks(self.manager, tenant, ids)[0]}
            gone = [b for ids in transcripts for b in chain_blocks(self.manager, tenant, ids)[0]]
            with self.manager.lock:
                self.manager.discard([b for b in gone if b.block_id not in kept])

    def save_all(self) -> int:
        saved = 0
        for key, token_ids in self.store.idle_transcripts(self.model_id):
            num_tokens = chain_blocks(self.manager, key.tenant, token_ids)[1]
            if num_tokens and not self.store.tiers.covers(key, token_ids[:num_tokens]):
                saved += self.save(key, token_ids)
            if self.store.tiers.pending_bytes() > MAX_PENDING_BYTES:
                self.store.tiers.flush_pending()  # a large pool is not copied into host RAM all at once
        return saved

    def save(self, key: SessionKey, token_ids: list[int]) -> bool:
        """Best effort: a session whose copy fails (e.g. out of memory) just recomputes later."""
        try:
            snapshot = gather(self.pool, self.manager, key, token_ids, self.model_id, self.fingerprint)
            if snapshot is None:
                return False
            self.store.tiers.put(snapshot)
        except Exception:
            log.exception("copying the K/V of session %s down a tier failed", key.name)
            return False
        if not self.store.is_live(key):
            self.store.tiers.drop(key)  # deleted while it was copied
            return False
        self.num_spilled += 1
        return True
