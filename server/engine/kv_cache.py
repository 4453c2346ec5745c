"""One sequence's K/V for a transformers model: growable buffers, crop, honest byte counts.

transformers' DynamicLayer appends with torch.cat, copying the whole history on every
decoded token. GrowableLayer keeps a buffer with spare capacity and writes in place, so a
decode step costs O(new tokens); the views it hands to attention are slices of the buffer.
The bytes a cache holds are those of the buffers' storages, not of the visible slices.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

GROW_QUANTUM = 256  # tokens; capacity grows by at least this much, or by 25%


class GrowableLayer(DynamicLayer):
    """A full-attention cache layer with amortised O(1) appends. Buffers: [B, H, capacity, D]."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.num_tokens = 0
        self._k_buf = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self._v_buf = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self._refresh_views()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.num_tokens, self.num_tokens + key_states.shape[-2]
        if end > self._k_buf.shape[-2]:
            self._reserve(end)
        self._k_buf[..., start:end, :] = key_states
        self._v_buf[..., start:end, :] = value_states
        self.num_tokens = end
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.num_tokens if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        # Same convention as transformers 5.24: a negative count of tokens to drop.
        if self.is_initialized and tokens_to_remove < 0:
            self.num_tokens = max(0, self.num_tokens + tokens_to_remove)
            self._refresh_views()

    def reset(self) -> None:
        self.keys = self.values = self._k_buf = self._v_buf = None
        self.num_tokens = 0
        self.is_initialized = False

    def shrink_to_fit(self) -> None:
        """Give back large spare capacity (a copy) when the sequence goes idle in the store.

        Headroom of an eighth of the length stays: the next turn appends tens of tokens, and
        regrowing right after a shrink would copy the whole history twice per turn.
        """
        headroom = self.num_tokens // 8
        if self.is_initialized and self._k_buf.shape[-2] - self.num_tokens > 2 * headroom + 16:
            self._k_buf = _regrow(self._k_buf, self.num_tokens + headroom, self.num_tokens)
            self._v_buf = _regrow(self._v_buf, self.num_tokens + headroom, self.num_tokens)
            self._refresh_views()

    def storages(self) -> list[torch.Tensor]:
        return [self._k_buf, self._v_buf] if self.is_initialized else []

    def _reserve(self, num_needed: int) -> None:
        capacity = max(num_needed, self._k_buf.shape[-2] + GROW_QUANTUM, int(num_needed * 1.25))
        self._k_buf = _regrow(self._k_buf, capacity, self.num_tokens)
        self._v_buf = _regrow(self._v_buf, capacity, self.num_tokens)

    def _refresh_views(self) -> None:
        self.keys = self._k_buf[..., : self.num_tokens, :]
        self.values = self._v_buf[..., : self.num_tokens, :]


def _regrow(buf: torch.Tensor, capacity: int, num_used: int) -> torch.Tensor:
    new = buf.new_empty((*buf.shape[:2], capacity, buf.shape[-1]))
    new[..., :num_used, :] = buf[..., :num_used, :]
    return new


def new_cache(config) -> DynamicCache:
    """A cache for one sequence; full-attention layers become GrowableLayer, others stay as transformers built them."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def is_croppable(cache: DynamicCache) -> bool:
    return all(isinstance(layer, GrowableLayer) for layer in cache.layers)


def crop_cache(cache: DynamicCache, num_tokens: int) -> bool:
    """Keep the first `num_tokens` positions. False when this cache cannot be cropped (sliding layers)."""
    if num_tokens >= cache.get_seq_length():
        return True
    if not is_croppable(cache):
        return False
    for layer in cache.layers:
        layer.crop(num_tokens - layer.get_seq_length())
    return True


def shrink_cache(cache: DynamicCache) -> None:
    for layer in cache.layers:
        if isinstance(layer, GrowableLayer):
            layer.shrink_to_fit()


def cache_nbytes(cache: DynamicCache) -> int:
    """Bytes of storage this cache keeps alive; each storage counted once, however it is viewed."""
    seen: dict[int, int] = {}
    for layer in cache.layers:
        tensors = layer.storages() if isinstance(layer, GrowableLayer) else _plain_tensors(layer)
        for tensor in tensors:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _plain_tensors(layer) -> list[torch.Tensor]:
    return [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t)]


def kv_layout(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model's K/V."""
    text = config.get_text_config(decoder=True)
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, num_kv_heads, head_dim


def bytes_per_token(config, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    num_layers, num_kv_heads, head_dim = kv_layout(config)
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def cache_from_snapshot(config, snapshot, prompt_ids: list[int], device) -> tuple[DynamicCache | None, int]:
    """A cache holding the snapshot's K/V for its common prefix with the prompt (at least one token left)."""
    num_tokens = 0
    for a, b in zip(snapshot.token_ids, prompt_ids[:-1], strict=False):
        if a != b:
            break
        num_tokens += 1
    cache = new_cache(config)
    if num_tokens == 0 or not is_croppable(cache) or len(cache.layers) != len(snapshot.k):
        return None, 0
    snapshot.wait()
    for layer, k, v in zip(cache.layers, snapshot.k, snapshot.v, strict=True):
        layer.update(k[None, :, :num_tokens].to(device), v[None, :, :num_tokens].to(device))  # [1, kvH, T, D]
    return cache, num_tokens
