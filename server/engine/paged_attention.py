"""Attention over a paged K/V pool, plugged into transformers' attention interface.

The pool holds, per layer, K and V as [kv_heads, num_blocks * block_size, head_dim]; a
token's slot is block_id * block_size + offset. One engine step is one forward pass over a
packed row of tokens from many sequences ([1, T]); the step's metadata rides along as a
forward kwarg (`kvserve_step`), which transformers hands to the attention function of every
layer. There the new K/V are written to their slots, and each sequence attends to its own
slots. Called without that kwarg (HF generate, the per-session path), it is plain SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTN_NAME = "kvserve_paged"
STEP_KWARG = "kvserve_step"


class KVPool:
    def __init__(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        # empty, not zeros: slots are read only after they are written, and untouched pages cost no RAM
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v)

    def copy_slots(self, src_block: int, dst_block: int, num_slots: int) -> None:
        """Divergence inside a block: the new block starts as a copy of the matching slots."""
        src, dst = src_block * self.block_size, dst_block * self.block_size
        for tensor in self.k + self.v:
            tensor[:, dst : dst + num_slots] = tensor[:, src : src + num_slots]


@dataclass(slots=True)
class SeqSpan:
    q_start: int  # this sequence's first token in the packed row
    q_len: int
    ctx_slots: torch.Tensor | None  # [ctx] slot ids of its whole context, or None when contiguous
    ctx_range: tuple[int, int]  # (first slot, end slot) when the context is one contiguous run
    mask: torch.Tensor | None  # [q, ctx] bool, True = may attend; None for a single query token


@dataclass(slots=True)
class StepMeta:
    pool: KVPool
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    spans: list[SeqSpan]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, H, T, D], key/value [1, kvH, T, D] -> ([1, T, H, D], None)."""
    step: StepMeta | None = kwargs.get(STEP_KWARG)
    if step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    layer = module.layer_idx
    k_pool, v_pool = step.pool.k[layer], step.pool.v[layer]  # [kvH, S, D]
    k_pool.index_copy_(1, step.slot_mapping, key[0].to(k_pool.dtype))
    v_pool.index_copy_(1, step.slot_mapping, value[0].to(v_pool.dtype))
    out = query.new_empty((query.shape[2], query.shape[1], query.shape[3]))  # [T, H, D]
    for span in step.spans:
        if span.ctx_slots is None:
            k = k_pool[:, span.ctx_range[0] : span.ctx_range[1]]  # a view: no copy
            v = v_pool[:, span.ctx_range[0] : span.ctx_range[1]]
        else:
            k = k_pool.index_select(1, span.ctx_slots)
            v = v_pool.index_select(1, span.ctx_slots)
        q = query[:, :, span.q_start : span.q_start + span.q_len]  # [1, H, q, D]
        o = F.scaled_dot_product_attention(
            q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=span.mask, scale=scaling, enable_gqa=True
        )  # [1, H, q, D]
        out[span.q_start : span.q_start + span.q_len] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def install(model) -> None:
    """Route this model's attention through `paged_attention` (SDPA when no step is given)."""
    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTN_NAME)


def unpageable_reason(model, max_context: int) -> str | None:
    """Why this model cannot run on the paged pool, or None when it can."""
    config = model.config.get_text_config(decoder=True)
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route attention through transformers' attention interface"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"it mixes attention kinds ({sorted(set(layer_types))})"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < max_context:
        return f"it uses a sliding window of {window} tokens"
    if getattr(config, "attn_logit_softcapping", None):
        return "it soft-caps attention logits"
    return None
