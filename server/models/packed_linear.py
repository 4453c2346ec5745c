"""bf16 and fp32 linear layers on the CPU with their weights packed once for oneDNN, instead of on every call.

A plain bf16 `linear` on the CPU re-lays-out its weight for oneDNN's kernels (AMX tiles or
AVX512-BF16) on every call: at the few rows of a decode step that costs more than the product.
Packing each weight once, at load, is what inductor's freezing does for a compiled model; here it
is done on the eager model, so every step, decode or prefill chunk, gets it without a compile.
In bf16 the answers are the same products (same kernels, same accumulation); only the weight's
layout differs. An fp32 `linear` goes to MKL's sgemm instead, which on a 2-core AVX512 EPYC took
7.5 ms for the default model's LM head at one row (2.1 ms packed) and 2.3x as long as oneDNN for a
1,024-row prefill: packed, fp32 decodes 1.75x faster and prefills 1.3x. oneDNN sums in another
order than sgemm, so fp32 logits differ from transformers' in the last bits (greedy ids agree in
the tests). Tied weights (an LM head sharing the embedding) are packed as a copy: the embedding
keeps reading the original.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("kvserve.registry")
ROWS_HINT = 1  # the layout oneDNN picks for this many rows; it serves any number of rows


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight packed for oneDNN (bf16 or fp32, CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def can_pack(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every nn.Linear of the model in `dtype` (the model's: not a layer it keeps in fp32 beside bf16 ones)
    for a PackedLinear; returns how many were packed."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == dtype
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
