"""bf16 linear layers on the CPU with their weights packed once for oneDNN, instead of on every call.

A plain bf16 `linear` on the CPU re-lays-out its weight for oneDNN's kernels (AMX tiles or
AVX512-BF16) on every call: at the few rows of a decode step that costs more than the product.
Packing each weight once, at load, is what inductor's freezing does for a compiled model; here it
is done on the eager model, so every step, decode or prefill chunk, gets it without a compile.
The answers are the same products (same kernels, same accumulation); only the weight's layout
differs. Tied weights (an LM head sharing the embedding) are packed as a copy: the embedding
keeps reading the original.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("kvserve.registry")
ROWS_HINT = 1  # the layout oneDNN picks for this many rows; it serves any number of rows


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight packed for oneDNN (bf16, CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def can_pack(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of the model for a PackedLinear; returns how many were packed."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16  # not a layer the model keeps in fp32
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
