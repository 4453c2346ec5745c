"""What a loaded model's weights hold, in bytes, by the form they are kept in (GET /v1/models/{id}, the load log).

Each storage is counted once, whole (the design's byte-accounting rule): a view counts its whole storage, tensors
sharing one (a tied LM head's weight and the embedding, before packing) count it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from server.models.packed_linear import PackedLinear


@dataclass(slots=True, frozen=True)
class WeightBytes:
    dense: int  # parameters and buffers as torch tensors: the embedding, norms, biases; every weight not packed
    packed: int  # linear weights packed for oneDNN (a tied LM head's is a copy: the embedding keeps the original)
    gemv: int  # the copies of them laid out for kvserve::bf16_gemv (decode steps), while an engine uses them


def weight_bytes(model: nn.Module) -> WeightBytes:
    """The model's weights as its modules hold them now."""
    dense: dict[tuple[str, int], int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_mkldnn:  # a packed layer's weight: counted below
            _add(dense, tensor)
    packed: dict[int, int] = {}
    gemv: dict[tuple[str, int], int] = {}
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            # oneDNN's tensor has no storage to ask; its blocked layout pads a dimension to the block where it is
            # not a multiple of one (the default model's are multiples of 64: 56,628,464 bytes allocated for its
            # LM head's 56,623,104). Copies of a layer share it (PackedLinear.__deepcopy__).
            packed[id(layer.packed)] = layer.packed.numel() * layer.packed.element_size()
            if layer.gemv is not None:
                _add(gemv, layer.gemv)
    return WeightBytes(sum(dense.values()), sum(packed.values()), sum(gemv.values()))


def _add(storages: dict[tuple[str, int], int], tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":  # a shape, no memory
        return
    storage = tensor.untyped_storage()
    if storage.nbytes():
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
