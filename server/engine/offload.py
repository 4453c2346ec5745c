"""Moving a session's K/V between the paged device pool and a host-side Snapshot.

Down: the blocks holding a transcript's prefix are gathered into per-layer tensors
[kv_heads, tokens, head_dim] on the host (pinned, asynchronous on CUDA). Up: a snapshot's
tokens are written into freshly allocated blocks and published under their prefix hashes,
so the request that restored them, and any later one, finds them like computed blocks.
"""

from __future__ import annotations

import torch

from server.engine.block_manager import Block, BlockManager
from server.engine.paged_attention import KVPool
from server.engine.snapshot import Snapshot
from server.engine.types import SessionKey


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
    prefer = shared[-1].block_id + 1 if shared else None
    restored: list[Block] = []
    for start in range(len(shared) * bs, num_tokens, bs):
        end = min(start + bs, num_tokens)
        block = manager.allocate(prefer)
        dst = block.block_id * bs
        for pool_k, pool_v, k, v in zip(pool.k, pool.v, snapshot.k, snapshot.v, strict=True):
            pool_k[:, dst : dst + end - start].copy_(k[:, start:end], non_blocking=True)
            pool_v[:, dst : dst + end - start].copy_(v[:, start:end], non_blocking=True)
        manager.record(block, parent, list(snapshot.token_ids[start:end]))
        restored.append(block)
        parent, prefer = block.hash, block.block_id + 1
    return restored
