"""Attention over the paged K/V pool, plugged into transformers' attention interface.

One engine step is one forward pass over a packed row of tokens from many sequences ([1, T]);
the model runner sets the step's metadata for the forward (`stepping`), and every layer's attention
function reads it. In a compiled model (server/engine/compiled.py) the attention is the custom op
`kvserve::step_attention`, opaque to inductor, which reads the step the same way: the graph holds
tensors only, and the step's Python objects never meet a guard. There the new K/V are written to their slots and each
sequence attends to its own slots: the decode rows the model runner hands the kernel in one call of
the paged decode kernel (server/kv/csrc), which reads the pool through the block tables; every other
row or span (prefill chunks, long rows on one run of blocks) in one SDPA call each, on a view of the
pool when its blocks are consecutive. Long decode rows may come with a head (cascade attention): keys
they share with other rows, attended for all of them in one flash call whose output and log-sum-exp
the kernel resumes from. Without the kernel (no compiler, or CUDA) all rows are spans.
transformers also passes the layer's `sliding_window` (a key is visible when
query_pos - key_pos < window) and `softcap` (Gemma-2's tanh capping of the scores): both are
honoured on both paths. Called outside a step (HF generate in tests, a compile's
warm-up) it is plain causal attention over the tensors it is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from server.kv.head_layouts import HeadLayout
from server.kv.pool import KVPool

ATTN_NAME = "kvserve_paged"
PROBE_NAME = "kvserve_probe"
ATTENTION_INPUTS_ATTR = "_kvserve_attention_inputs"
LAYER_TYPES = ("full_attention", "sliding_attention")
# What paged_attention honours (sliding_window, softcap, scaling) or may ignore: positions are already in the
# rotated queries and keys, and dropout is 0 at inference.
HANDLED_INPUTS = {"dropout", "scaling", "sliding_window", "softcap", "position_ids"}


@dataclass(slots=True)
class SeqSpan:
    """One sequence's part of a step: its queries in the packed row and where its context sits in the pool."""

    q_start: int  # this sequence's first token in the packed row
    q_len: int
    ctx_len: int  # keys it attends to: positions 0 .. ctx_len - 1 (the new tokens are the last q_len)
    ctx_slots: torch.Tensor | None  # [ctx_len] slot ids, or None when the context is one contiguous run
    first_slot: int  # when contiguous: the slot of position 0
    device: torch.device
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def keys(self, window: int | None) -> tuple[int, int]:
        """The key positions [lo, ctx_len) a layer with this window can see from this span's queries."""
        first_query = self.ctx_len - self.q_len
        lo = 0 if window is None else max(0, first_query - window + 1)
        return lo, self.ctx_len

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[q_len, ctx_len - lo] bool, True = may attend; None when every key is visible to every query."""
        if self.q_len == 1:
            return None  # one query at the end: `keys` already dropped what its window cannot see
        if window not in self._masks:
            lo, hi = self.keys(window)
            queries = self.ctx_len - self.q_len + torch.arange(self.q_len, device=self.device)  # positions
            keys = torch.arange(lo, hi, device=self.device)
            visible = keys[None, :] <= queries[:, None]  # never all true: the first query does not see the last key
            if window is not None:
                visible &= keys[None, :] > queries[:, None] - window
            self._masks[window] = visible
        return self._masks[window]


@dataclass(slots=True, frozen=True)
class SharedHead:
    """The first `length` keys of some decode rows, the same slots for each: attended in one batched call.

    Rows of one sequence group (forks, or conversations behind one cached system prompt) share their
    prefix blocks; a lone row's head is the leading run of consecutive blocks, read as a view.
    """

    rows: torch.Tensor  # [n] long: the rows' index in the packed row
    length: int  # keys 0 .. length - 1
    first_slot: int  # when the head's slots are one run: the slot of key 0
    slots: torch.Tensor | None  # [length] slot ids when they are not one run (gathered once per layer)
    blocks: torch.Tensor | None = None  # [length / block size] int32: the head's blocks, for the paged kernel
    laid_out: HeadLayout | None = None  # with blocks: the kernel's layout of them, kept across steps

    def kv(self, pool: torch.Tensor) -> torch.Tensor:
        """[kvH, length, D]: a view of the pool, or a gather of it."""
        if self.slots is None:
            return pool[:, self.first_slot : self.first_slot + self.length]
        return pool.index_select(1, self.slots)


@dataclass(slots=True, frozen=True)
class DecodeRows:
    """The step's single-token rows, for the paged decode kernel (int32, on the pool's device)."""

    rows: torch.Tensor  # [B] their index in the packed row
    block_tables: torch.Tensor  # [B, max blocks] each row's blocks in order (padded with 0)
    context_lens: torch.Tensor  # [B] keys each attends to, its own token last
    # Cascade attention: the rows with a head come first, in the heads' order; first_keys[b] is the length of
    # row b's head (0: none). Heads are used by layers without window or softcap; others take whole rows.
    heads: list[SharedHead] = field(default_factory=list)
    first_keys: torch.Tensor | None = None  # [B] int32


@dataclass(slots=True, frozen=True)
class PrefillRows:
    """The step's multi-token spans (prefill chunks), for the paged prefill kernel (int32, on the pool's device)."""

    q_starts: torch.Tensor  # [N] each span's first row in the packed row
    q_lens: torch.Tensor  # [N] its tokens
    context_lens: torch.Tensor  # [N] its keys, its own tokens last
    block_tables: torch.Tensor  # [N, max blocks] its blocks in order (padded with 0)
    # A quantized pool: the slots of the blocks the tables name, block i of the tables being the i-th run of
    # block_size slots here (the kernel reads them dequantized, a copy per layer)
    slots: torch.Tensor | None = None


class Attends(Protocol):
    """What runs a step's layer: the model's attention backend (server/kv/backends.py)."""

    def attend(
        self,
        step: StepMeta,
        layer: int,
        query: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> None: ...

    def write(self, step: StepMeta, layer: int, key: torch.Tensor, value: torch.Tensor) -> None: ...


@dataclass(slots=True)
class StepMeta:
    """A step's attention, as its backend planned it (server/kv/backends.py) and runs it, layer by layer."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    spans: list[SeqSpan]  # the rows attended to one SDPA call each
    decode: DecodeRows | None = None  # the rows a kernel attends to in one call
    prefill: PrefillRows | None = None  # the chunks the prefill kernel attends to in one call (no window, no softcap)
    backend: Attends | None = None  # runs each layer (None: every row is a span)
    launch: Any = None  # what the backend keeps for this step's kernels (the Triton backend's grids and workspace)
    num_op_calls: int = 0  # layers attended through kvserve::step_attention (a compiled graph's)
    # Asked before each layer after the first: True abandons the step (StepAbandoned), as when every request in
    # it has gone (a long prefill's client left: its session is free within a layer, not a whole step later).
    is_abandoned: Callable[[], bool] | None = None


class StepAbandoned(Exception):
    """A step stopped between layers because nothing it computes is wanted any more: the K/V it wrote is in blocks
    no one has published, its rows' requests are ended by the engine."""


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None
) -> torch.Tensor:
    """q [1, H, q, D], k/v [1, kvH, ctx, D], mask [q, ctx] bool or None -> [1, H, q, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # as transformers' eager path
    return torch.matmul(probs, v)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, kvH, T, D] -> ([1, T, H, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if torch.compiler.is_compiling():  # the step is read when the op runs, not when it is traced
        layer = int(module.layer_idx)  # type: ignore[arg-type]
        return step_attention(query, key, value, layer, scale, sliding_window or 0, softcap or 0.0), None
    step = current_step()
    if step is None:
        return _dense(module, query, key, value, attention_mask, scale, sliding_window, softcap, **kwargs)
    return _paged(step, int(module.layer_idx), query, key, value, scale, sliding_window, softcap), None  # type: ignore[arg-type]


_STEP = threading.local()  # the step the engine thread runs now


@contextmanager
def stepping(step: StepMeta) -> Iterator[None]:
    """Attention in this thread attends over the pool as `step` says, until the block ends."""
    outer = current_step()
    _STEP.meta = step
    try:
        yield
    finally:
        _STEP.meta = outer


def current_step() -> StepMeta | None:
    meta: StepMeta | None = getattr(_STEP, "meta", None)
    return meta


@torch.library.custom_op("kvserve::step_attention", mutates_args=())
def step_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int,
    softcap: float,
) -> torch.Tensor:
    """paged_attention for a compiled graph ([1, T, H, D]); 0 stands for no window, no softcap. The new K/V are
    written to the pool (a side effect inductor does not see; each layer reads only what its own call wrote)."""
    window, cap = sliding_window or None, softcap or None
    step = current_step()
    if step is not None:
        step.num_op_calls += 1
        return _paged(step, layer, query, key, value, scale, window, cap)
    n = query.shape[2]  # outside a step (a compile's warm-up): causal attention over the tokens given
    positions = torch.arange(n, device=query.device)
    visible = positions[None, :] <= positions[:, None]
    if window is not None:
        visible &= positions[None, :] > positions[:, None] - window
    return attend(query, key, value, visible, scale, cap).transpose(1, 2).contiguous()


@step_attention.register_fake
def _(query: torch.Tensor, *_: object) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


def _paged(
    step: StepMeta,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The step's attention for one layer: the new K/V into their slots, then each row over its keys as the
    step's backend planned it."""
    if layer and step.is_abandoned is not None and step.is_abandoned():
        raise StepAbandoned(f"abandoned before layer {layer}")
    out = query.new_empty((query.shape[2], query.shape[1], query.shape[3]))  # [T, H, D]
    if step.backend is not None:
        step.backend.write(step, layer, key[0], value[0])
        step.backend.attend(step, layer, query, out, scale, sliding_window, softcap)
    else:
        step.pool.write(layer, step.slot_mapping, key[0], value[0])
        attend_spans(step, layer, query, out, scale, sliding_window, softcap)
    return out.unsqueeze(0)


def attend_spans(
    step: StepMeta,
    layer: int,
    query: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> None:
    """Each span: one SDPA call over its keys (a view of the pool when they are one run, else a gather)."""
    pool = step.pool
    for span in step.spans:
        lo, hi = span.keys(window)
        slots = None if span.ctx_slots is None else span.ctx_slots[lo:hi]
        k, v = pool.read(layer, span.first_slot + lo, span.first_slot + hi, slots)  # contiguous: a view, no copy
        q = query[:, :, span.q_start : span.q_start + span.q_len]  # [1, H, q, D]
        o = attend(q, k.unsqueeze(0), v.unsqueeze(0), span.mask(window), scale, softcap)
        out[span.q_start : span.q_start + span.q_len] = o[0].transpose(0, 1)


def flash_heads(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, heads: list[SharedHead], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's rows against its keys in one call of torch's CPU flash attention: ([Bh, H, D] output, [Bh, H]
    log-sum-exp), a kv head's G query heads of all n rows as one sequence of G * n queries (no mask: the head's
    keys all precede every row's token), on a view of the pool or a gather of its slots."""
    num_heads, dim = query.shape[1], query.shape[3]
    kv_heads = k_pool.shape[0]
    outs, lses = [], []
    for head in heads:
        n = head.rows.numel()
        q = query[0].index_select(1, head.rows).view(1, kv_heads, num_heads // kv_heads * n, dim)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, head.kv(k_pool)[None], head.kv(v_pool)[None], scale=scale
        )
        outs.append(o.view(num_heads, n, dim).transpose(0, 1))  # [n, H, D]
        lses.append(lse.reshape(num_heads, n).transpose(0, 1))  # [n, H]
    if len(heads) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def _dense(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Without a step (HF generate): the mask transformers built already holds the causal and window rules."""
    if softcap is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, **kwargs)
        return out, None
    mask = attention_mask
    if mask is None:  # transformers skipped it as plainly causal
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril(
            key.shape[2] - query.shape[2]
        )
    elif mask.dtype != torch.bool:
        mask = mask == 0  # an additive float mask: 0 where visible
    out = attend(query, key, value, mask, scale, softcap)
    return out.transpose(1, 2).contiguous(), None


def install(model: torch.nn.Module) -> None:
    """Route this model's attention through `paged_attention`."""
    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(ATTN_NAME)  # type: ignore[operator]


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the paged engine cannot serve this model, or None when it can."""
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route attention through transformers' attention interface"
    config = model.config.get_text_config(decoder=True)  # type: ignore[operator, union-attr]
    unknown = sorted(set(getattr(config, "layer_types", None) or []) - set(LAYER_TYPES))
    if unknown:
        return f"its layers use attention kinds the paged pool does not implement ({', '.join(unknown)})"
    unhandled = sorted(attention_inputs(model) - HANDLED_INPUTS)
    if unhandled:  # e.g. GPT-OSS's attention sinks (`s_aux`): dropping them would change every answer
        return f"its attention takes inputs the paged attention does not implement ({', '.join(unhandled)})"
    return None


def attention_inputs(model: torch.nn.Module) -> set[str]:
    """The inputs transformers hands this model's attention function (flags aside), seen in a two-token forward.

    Kept on the model: the loader asks (can it be served?) and so does the runner (can rows share heads?).
    """
    known: frozenset[str] | None = getattr(model, ATTENTION_INPUTS_ATTR, None)
    if known is not None:
        return set(known)
    seen: set[str] = set()

    def probe(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        seen.update(name for name, value in kwargs.items() if value is not None and not isinstance(value, bool))
        return query.transpose(1, 2).contiguous(), None  # [B, T, H, D]: the shape the output projection takes

    previous = model.config._attn_implementation  # type: ignore[union-attr]
    AttentionInterface.register(PROBE_NAME, probe)
    AttentionMaskInterface.register(PROBE_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(PROBE_NAME)  # type: ignore[operator]
    try:
        with torch.inference_mode():
            device = next(model.parameters()).device
            model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)  # type: ignore[operator]
    setattr(model, ATTENTION_INPUTS_ATTR, frozenset(seen))
    return seen
