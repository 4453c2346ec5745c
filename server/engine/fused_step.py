"""A decode step of a Llama-family model as one call of our C++ kernel (kvserve::decode_step), not ~35 torch calls
a layer through transformers' modules.

At a decode step's few rows a small model's step is bound by its weights' read (the default model's 270 MB:
~6-7 ms on a 2-core EPYC) and by everything around the products: in transformers' modules each layer is some
35 torch calls (norms, rotary, reshapes, residual adds, the attention hook) dispatched from Python, several of
them a fork and join of the OpenMP team. The fused step runs the same arithmetic (rounded where the modules
round it; server/kv/csrc/decode_step.cpp) over the same weights: the products' copies laid out for bf16_gemv,
the K/V pool, the paged decode kernel. The model's own modules still do what differs among families and is
cheap once a step: the embedding, the rotary factors (every rope type and scaling stays transformers'), the
LM head.

It serves steps whose rows are all single tokens (1 to GEMV_MAX_ROWS), each attended by the backend's decode
kernel (the tiled walk or paged_decode) over its own keys (no cascade head, no span), on bf16 models whose
decoder layers are Llama's (Llama, Mistral without a window, Qwen2); every other step, and every other model,
runs through the modules. `FusedDecode.of` says why it does not apply, for GET /v1/models/{id}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from server.kv.attention import DecodeRows
from server.kv.pool import KVPool
from server.models.packed_linear import GEMV_MAX_ROWS, FusedLinear, PackedLinear

# Decoder layers whose forward is Llama's: pre-norm RMSNorm, q/k/v with rotary, o, RMSNorm, SiLU-gated MLP
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True, slots=True)
class FusedWeights:
    """What kvserve::decode_step reads, layer by layer (the tensors the model's modules hold, not copies)."""

    input_norms: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor]  # empty: no bias
    o: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    final_norm: torch.Tensor
    eps: float
    scale: float
    num_heads: int
    num_kv_heads: int


class FusedDecode:
    """The model's decode steps by kvserve::decode_step (see the module's docstring)."""

    def __init__(self, model: nn.Module, pool: KVPool, weights: FusedWeights, tiled: bool) -> None:
        inner: Any = model.model
        self.embed: nn.Module = inner.embed_tokens
        self.rotary: nn.Module = inner.rotary_emb
        self.head: nn.Module = model.lm_head  # type: ignore[assignment]
        self.pool, self.weights = pool, weights
        self.tiled = tiled  # attention by the tiled walk (the tiled backend's decode rows), else paged_decode
        self.num_steps = 0  # steps it ran: the proof, in tests, that decode steps take it

    @classmethod
    def of(cls, model: nn.Module, pool: KVPool, tiled: bool) -> tuple[FusedDecode | None, str]:
        """The fused step for this model and pool, its rows attended by the tiled walk or the decode kernel (as the
        backend attends them), or None and why not (in words)."""
        weights, why = fused_weights(model)
        if weights is None:
            return None, why
        if pool.is_quantized or pool.layout.dtype != torch.bfloat16:
            return None, "needs a bf16 K/V pool (not quantized)"
        return cls(model, pool, weights, tiled), f"decode steps of 1 to {GEMV_MAX_ROWS} rows by kvserve::decode_step"

    @staticmethod
    def serves(decode: DecodeRows | None, num_tokens: int, has_spans: bool, has_prefill: bool) -> bool:
        """Whether a planned step is one it runs: every row a plain decode kernel row."""
        return (
            decode is not None
            and not has_spans
            and not has_prefill
            and decode.first_keys is None
            and 0 < num_tokens <= GEMV_MAX_ROWS
            and decode.rows.numel() == num_tokens
        )

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        decode: DecodeRows,
        sampled_at: torch.Tensor,
    ) -> torch.Tensor:
        """The step's logits [R, V] for the rows `sampled_at` (input and position ids [1, T])."""
        w, pool = self.weights, self.pool
        hidden = self.embed(input_ids)  # [1, T, E]
        cos, sin = self.rotary(hidden, position_ids)  # [1, T, D] each, in the model's dtype
        normed = torch.ops.kvserve.decode_step(
            hidden[0].contiguous(),
            cos[0].contiguous(),
            sin[0].contiguous(),
            slot_mapping,
            decode.rows,
            decode.block_tables,
            decode.context_lens,
            w.input_norms,
            w.qkv,
            w.qkv_bias,
            w.o,
            w.post_norms,
            w.gate_up,
            w.down,
            pool.k,
            pool.v,
            w.final_norm,
            w.num_heads,
            w.num_kv_heads,
            pool.block_size,
            w.eps,
            w.scale,
            self.tiled,
        )
        self.num_steps += 1
        logits: torch.Tensor = self.head(normed.index_select(0, sampled_at))
        return logits


def fused_weights(model: nn.Module) -> tuple[FusedWeights | None, str]:
    """The weights the fused step reads, or None and why the model's layers are not ones it computes."""
    if type(model).__name__ not in MODELS:
        return None, f"{type(model).__name__} is not a Llama-family model"
    config: Any = model.config.get_text_config(decoder=True)  # type: ignore[operator, union-attr]
    if getattr(config, "hidden_act", None) != "silu":
        return None, f"its MLP's activation is {getattr(config, 'hidden_act', None)}, not silu"
    inner: Any = model.model
    layers: list[Any] = list(inner.layers[: config.num_hidden_layers])
    norms: list[Any] = [inner.norm]
    names = ("input_norms", "qkv", "qkv_bias", "o", "post_norms", "gate_up", "down")
    w: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    scales = set()
    for layer in layers:
        if type(layer).__name__ not in LAYERS:
            return None, f"its decoder layers are {type(layer).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o = getattr(attn, "packed_q_k_v", None), getattr(attn, "o_proj", None)
        gate_up, down = getattr(mlp, "packed_gate_up", None), getattr(mlp, "down_proj", None)
        if not (isinstance(qkv, FusedLinear) and isinstance(gate_up, FusedLinear)):
            return None, "its projections are not packed as one q/k/v and one gate/up product"
        products: list[Any] = [qkv, o, gate_up, down]
        if not all(isinstance(p, PackedLinear) and p.gemv is not None for p in products):
            return None, "its products have no bf16_gemv copies (bf16 on AVX512-BF16, outside deterministic mode)"
        if any(p.bias is not None for p in products[1:]):
            return None, "its o, gate, up or down products have a bias"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        w["input_norms"].append(layer.input_layernorm.weight)
        w["post_norms"].append(layer.post_attention_layernorm.weight)
        if qkv.bias is not None:
            w["qkv_bias"].append(qkv.bias.detach())
        for name, product in zip(("qkv", "o", "gate_up", "down"), products, strict=True):
            w[name].append(product.gemv)
        scales.add(float(attn.scaling))
    if any(type(n).__name__ not in NORMS for n in norms):
        return None, "its norms are not Llama's RMSNorm"
    eps = {float(n.variance_epsilon) for n in norms}
    if len(eps) != 1 or len(scales) != 1:
        return None, "its layers differ in norm epsilon or attention scale"
    if w["qkv_bias"] and len(w["qkv_bias"]) != len(layers):
        return None, "some of its q/k/v products have a bias and some not"
    if any(t.dtype != torch.bfloat16 for t in w["input_norms"] + w["post_norms"] + [inner.norm.weight]):
        return None, "its norms are not bf16"
    weights = FusedWeights(
        **{k: [t.detach() for t in v] for k, v in w.items()},
        final_norm=inner.norm.weight.detach(),
        eps=eps.pop(),
        scale=scales.pop(),
        num_heads=int(config.num_attention_heads),
        num_kv_heads=int(config.num_key_value_heads),
    )
    return weights, ""
