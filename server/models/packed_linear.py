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

In deterministic mode a row's product must not depend on the rows beside it in the call. oneDNN
picks its kernel by the number of rows, so `batch_invariance` probes every layer at load and pads
the rows of the shapes where that is needed (engine/model_runner.py, docs/architecture.md).
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
GEMV_MAX_ROWS = 8  # calls of at most this many rows go to kvserve::bf16_gemv where a layer has its copy
ROW_TILE = 16  # deterministic mode, where a product's rows depend on how many there are: padded to a multiple
PROBE_ROWS = (1, 2, 3, 5, 8, 16, 17, 33, 64, 70)  # step sizes the batch-invariance probe compares
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()  # by handle, while alive


class PackedLinear(nn.Module):
    """nn.Linear's forward on a weight packed for oneDNN (bf16 or fp32, CPU)."""

    row_multiple = 1  # deterministic mode: the rows padded to a multiple of this (`batch_invariance`)
    per_tile = False  # and multiplied row_multiple rows a call
    packed: torch.Tensor  # the weight in oneDNN's layout (a buffer)
    gemv: torch.Tensor | None = None  # the weight laid out for kvserve::bf16_gemv (`decode_products`), or None

    def __init__(self, linear: nn.Linear, name: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), persistent=False)
        self.bias = linear.bias
        self.name = name
        self.handle = _register(self, name)

    def __deepcopy__(self, memo: dict[int, object]) -> PackedLinear:
        """A copy is a layer of its own: its handle finds its weights (the original's packed ones, until replaced)."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        memo[id(self.packed)] = self.packed  # shared: never written, and oneDNN's layout cannot be copied as a tensor
        for key, value in self.__dict__.items():
            clone.__dict__[key] = copy.deepcopy(value, memo)
        clone.handle = _register(clone, self.name)
        return clone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.out_features)
        if self.gemv is not None and 0 < x.numel() <= GEMV_MAX_ROWS * self.in_features:
            return torch.ops.kvserve.bf16_gemv(x, self.gemv, self.bias)
        rows, tile = x.shape[-2], self.row_multiple
        pad = -rows % tile
        if pad:
            x = torch.cat([x, x.new_zeros((*x.shape[:-2], pad, x.shape[-1]))], -2)
        if self.per_tile and x.shape[-2] > tile:
            out = torch.cat([self._product(part) for part in x.split(tile, -2)], -2)
        else:
            out = self._product(x)
        return out[..., :rows, :] if pad else out

    def _product(self, x: torch.Tensor) -> torch.Tensor:
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


def batch_invariance(model: nn.Module) -> dict[str, int] | None:
    """Make the model's packed products batch-invariant (a row's result the same whatever rows share its call,
    and wherever it sits among them), as measured here. oneDNN picks its kernel by the number of rows, and two
    kernels may sum a row in different orders (on a 2-core AVX512 EPYC: bf16 down projections, K = 1,536, a
    row alone or elsewhere in the call; fp32 everywhere). A difference shows only where it crosses a rounding
    boundary, so every layer is probed, with 70 random rows: at PROBE_ROWS sizes and shifted, against all 70 at
    once and against rows alone. Each layer shape takes the cheapest way that holds for all its layers: as they are;
    rows padded to a multiple of ROW_TILE; or ROW_TILE rows a call (one kernel for every call). Returns how
    many layers take each way, or None (every layer left as it comes) when a shape has none, or when the
    model has linear layers that are not packed."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not layers or any(type(m) is nn.Linear for m in model.modules()):
        return None
    shapes: dict[tuple[int, int], list[PackedLinear]] = {}
    for layer in layers:
        shapes.setdefault((layer.in_features, layer.out_features), []).append(layer)
    ways = {"as they are": 1, f"rows padded to {ROW_TILE}": ROW_TILE, f"{ROW_TILE} rows a call": -ROW_TILE}
    taken = dict.fromkeys(ways, 0)
    for group in shapes.values():
        way = next((w for w, multiple in ways.items() if all(_invariant(m, multiple) for m in group)), None)
        if way is None:
            pad_rows(model, 1)
            return None
        for layer in group:
            layer.row_multiple, layer.per_tile = abs(ways[way]), ways[way] < 0
        taken[way] += len(group)
    return {way: n for way, n in taken.items() if n}


def _invariant(layer: PackedLinear, multiple: int) -> bool:
    kept = layer.row_multiple, layer.per_tile
    layer.row_multiple, layer.per_tile = abs(multiple), multiple < 0
    try:
        return _rows_invariant(layer, layer.in_features, layer.dtype, torch.device("cpu"))
    finally:
        layer.row_multiple, layer.per_tile = kept


def linear_invariance(model: nn.Module) -> dict[str, int] | None:
    """Whether the model's plain linear layers (as they are on a GPU: no packing, no padding) are batch-invariant,
    probed as `batch_invariance` probes packed ones, once per layer shape on that shape's first layer (the
    layers of one shape share their kernels): {"as they are": n} or None (a shape is not, e.g. where cuBLAS picks
    another kernel, or another split of the sum, for another row count)."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not layers:
        return None
    shapes: dict[tuple[int, int, torch.dtype], nn.Linear] = {}
    for layer in layers:
        shapes.setdefault((layer.in_features, layer.out_features, layer.weight.dtype), layer)
    invariant = all(_rows_invariant(m, m.in_features, m.weight.dtype, m.weight.device) for m in shapes.values())
    return {"as they are": len(layers)} if invariant else None


def _rows_invariant(layer: nn.Module, in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """A row's product the same whatever rows share the call: 70 random rows at PROBE_ROWS sizes, shifted by 37
    places, and alone, bit for bit."""
    rows = max(PROBE_ROWS)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((1, rows, in_features), generator=generator).to(device, dtype)
    with torch.inference_mode():
        whole = layer(x)
        same = all(torch.equal(layer(x[:, :n]), whole[:, :n]) for n in PROBE_ROWS)
        same = same and torch.equal(layer(x.roll(37, 1)), whole.roll(37, 1))
        return same and all(torch.equal(layer(x[:, i : i + 1]), whole[:, i : i + 1]) for i in (4, rows - 1))


def decode_products(model: nn.Module, on: bool) -> int:
    """Calls of 1 to GEMV_MAX_ROWS rows (decode steps) to our kernel, kvserve::bf16_gemv (on), or all to oneDNN.

    At a decode step's few rows a product is a read of its weight, and oneDNN's kernels read a packed weight at
    about 14 GB/s on a 2-core AVX512 EPYC whose memory gives 36-41; bf16_gemv reads a copy laid out for it at
    32-35 (the default model's products at one row: 7.7 ms a step against 15.2 ms; at 8 rows, 12 against 19).
    The copy is the price: the linear layers' weights held twice (270 MB more for the default model), the
    oneDNN one kept for larger calls (prefill chunks), where oneDNN's blocking wins. Its sums are in another
    order than oneDNN's, so a row's product differs in the last bits between a decode step and a prefill chunk:
    the engine turns it on only outside deterministic mode. Off frees the copies. Needs bf16 layers whose
    outputs are a multiple of 16 and inputs even, and the kernels built with AVX512-BF16 (the caller checks
    kvserve::bf16_gemv_available). Returns how many layers take it."""
    count = 0
    for layer in model.modules():
        if not isinstance(layer, PackedLinear):
            continue
        fits = layer.dtype == torch.bfloat16 and layer.out_features % 16 == 0 and layer.in_features % 2 == 0
        if on and fits:
            if layer.gemv is None:
                layer.gemv = torch.ops.kvserve.bf16_gemv_pack(layer.packed.to_dense())
            count += 1
        else:
            layer.gemv = None
    return count


def pad_rows(model: nn.Module, multiple: int) -> None:
    """Every packed layer's rows padded to a multiple of |multiple| (negative: also |multiple| rows a call); 1: as
    they come (the default; an engine not in deterministic mode sets it back on a model another one changed)."""
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            layer.row_multiple, layer.per_tile = abs(multiple), multiple < 0


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # products of one input, fused when packed


class FusedLinear(PackedLinear):
    """Sibling projections of one input (an attention's q, k and v; an MLP's gate and up) packed as one product,
    registered on their parent; each sibling is a FusedPart. The first part called on an input computes all of
    them at once, each part returns its columns of it, and the product is dropped once every part has read it.
    At a decode step's few rows a product costs its weight's read plus a fixed overhead: one call instead of three
    or two reads the weights faster (on a 2-core AVX512 EPYC, the default model's projections at one row: 15.4 ms a
    step fused, 19.9 ms apart). A part called on another input (a model that feeds them differently) computes the
    product for it: right, only slower. Each output column is the same dot product as in its own product. Under
    torch.compile dynamo traces the same bookkeeping (the input's identity, the parts still to read), so a graph
    calls kvserve::packed_linear once per fused product too (4 calls a layer, counted in the compiled engine)."""

    def __init__(self, linear: nn.Linear, name: str, parts: int) -> None:
        super().__init__(linear, name)
        self.parts = parts
        self._input: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._unread: set[int] = set()

    def __deepcopy__(self, memo: dict[int, object]) -> PackedLinear:
        self._input = self._out = None  # a copy starts with no product held
        self._unread = set()
        return super().__deepcopy__(memo)

    def part(self, x: torch.Tensor, index: int, start: int, end: int) -> torch.Tensor:
        if self._input is not x or index not in self._unread:
            self._input, self._out, self._unread = x, self(x), set(range(self.parts))
        assert self._out is not None
        out = self._out[..., start:end]
        self._unread.discard(index)
        if not self._unread:
            self._input = self._out = None
        return out


class FusedPart(nn.Module):
    """One sibling's product: its columns of its FusedLinear's."""

    def __init__(self, fused: FusedLinear, index: int, start: int, end: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a child: the parent holds it, and modules() lists it once
        self.index, self.start, self.end = index, start, end
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused: FusedLinear = self.__dict__["fused"]
        return fused.part(x, self.index, self.start, self.end)


def _fuse(parent: nn.Module, names: tuple[str, ...], path: str, key: str) -> FusedLinear | None:
    """`parent`'s sibling linears `names` packed as one product, each swapped for a FusedPart; None where they
    are not all plain linears of one input size, dtype and bias presence."""
    parts = [p for p in (getattr(parent, name, None) for name in names) if type(p) is nn.Linear]
    if len(parts) != len(names):
        return None
    first = parts[0]
    if any(
        p.in_features != first.in_features
        or p.weight.dtype != first.weight.dtype
        or p.weight.device != first.weight.device
        or (p.bias is None) != (first.bias is None)
        for p in parts
    ):
        return None
    outs = [p.out_features for p in parts]
    whole = nn.Linear(first.in_features, sum(outs), bias=first.bias is not None, device="meta")
    whole.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
    if first.bias is not None:
        whole.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    name = "+".join(names)
    fused = FusedLinear(whole, f"{key}:{path}.{name}" if path else f"{key}:{name}", len(parts))
    parent.add_module("packed_" + "_".join(n.removesuffix("_proj") for n in names), fused)
    start = 0
    for index, (child, size) in enumerate(zip(names, outs, strict=True)):
        setattr(parent, child, FusedPart(fused, index, start, start + size))
        start += size
    return fused


def pack_linears(model: nn.Module, dtype: torch.dtype, key: str = "") -> int:
    """Swap every nn.Linear of the model in `dtype` (the model's: not a layer it keeps in fp32 beside bf16 ones)
    for a PackedLinear named `key` and its path in the model, sibling projections of one input (SIBLINGS) as one
    product (FusedPart); returns how many linear layers were packed."""
    fused = 0
    for path, parent in list(model.named_modules()):
        for names in SIBLINGS:
            first = getattr(parent, names[0], None)
            if type(first) is nn.Linear and first.weight.dtype == dtype and _fuse(parent, names, path, key):
                fused += len(names)
    swaps = [
        (parent, f"{path}.{name}" if path else name, name, child)
        for path, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == dtype
    ]
    for parent, path, name, child in swaps:
        setattr(parent, name, PackedLinear(child, f"{key}:{path}"))
    return fused + len(swaps)
