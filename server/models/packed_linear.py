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

A compiled model (server/engine/compiled.py) cannot take these layers as they are: inductor can
neither lower a weight packed already nor trace an mkldnn tensor. Under `torch.compile` a packed
layer is the custom op `kvserve::packed_linear`, which inductor calls and never looks into; the op
takes the layer's handle (an int) rather than its weight, so the graph holds no mkldnn tensor and
inductor's cache can keep it across restarts. A handle is derived from the layer's name within its
model and the model's key, so the same model loaded again gets the same handles (and a cache hit).
"""

from __future__ import annotations

import copy
import logging
import weakref
import zlib

import torch
from torch import nn

log = logging.getLogger("kvserve.registry")
ROWS_HINT = 1  # the layout oneDNN picks for this many rows; it serves any number of rows
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()  # by handle, while alive


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight packed for oneDNN (bf16 or fp32, CPU)."""

    def __init__(self, linear: nn.Linear, name: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), persistent=False)
        self.bias = linear.bias
        self.name = name
        self.handle = _register(self, name)

    def __deepcopy__(self, memo: dict[int, object]) -> PackedLinear:
        """A copy is a layer of its own: its handle finds its weights (the original's packed ones, until replaced)."""
        clone = PackedLinear.__new__(PackedLinear)
        memo[id(self)] = clone
        memo[id(self.packed)] = self.packed  # shared: never written, and oneDNN's layout cannot be copied as a tensor
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        clone.handle = _register(clone, self.name)
        return clone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def _register(layer: PackedLinear, name: str) -> int:
    """The layer's handle: from its name, the next free one where a live layer holds that (a model loaded twice)."""
    handle = zlib.crc32(name.encode())
    while _LAYERS.get(handle) is not None:
        handle = (handle + 1) % 2**32
    _LAYERS[handle] = layer
    return handle


@torch.library.custom_op("kvserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """The packed layer `handle`'s product, for a compiled graph: [..., in] -> [..., out_features]."""
    layer = _LAYERS[handle]
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [None], "")


@packed_linear.register_fake
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def can_pack(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def pack_linears(model: nn.Module, dtype: torch.dtype, key: str = "") -> int:
    """Swap every nn.Linear of the model in `dtype` (the model's: not a layer it keeps in fp32 beside bf16 ones)
    for a PackedLinear named `key` and its path in the model; returns how many were packed."""
    swaps = [
        (parent, f"{path}.{name}" if path else name, name, child)
        for path, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == dtype
    ]
    for parent, path, name, child in swaps:
        setattr(parent, name, PackedLinear(child, f"{key}:{path}"))
    return len(swaps)
