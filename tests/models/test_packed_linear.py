"""Packed linears answer as the plain ones do: bf16 the same oneDNN products with another weight layout, fp32
oneDNN's products where the plain layer calls sgemm (equal to rounding, the same greedy ids)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from server.kv import kernels
from server.models import loader
from server.models.digest import state_dict_digest
from server.models.loader import load_model
from server.models.packed_linear import (
    GEMV_MAX_ROWS,
    ROW_TILE,
    FusedLinear,
    FusedPart,
    PackedLinear,
    batch_invariance,
    can_pack,
    decode_products,
    pack_linears,
    pad_rows,
)
from tests.helpers import make_engine, reference_greedy, run
from tests.tiny import build_model

needs_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no oneDNN bf16 kernels"
)


@needs_bf16
def test_a_packed_model_gives_the_plain_models_logits():
    plain = build_model(vocab_size=300, eos_id=1).to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert can_pack(packed, torch.device("cpu"), torch.bfloat16)
    assert pack_linears(packed, torch.bfloat16) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert isinstance(packed.lm_head, PackedLinear)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.inference_mode():
        for rows in (ids[:, :1], ids):  # a decode step's one row and a prefill's many
            expected = plain(input_ids=rows).logits.float()
            got = packed(input_ids=rows).logits.float()
            assert torch.allclose(got, expected, atol=2e-2, rtol=2e-2), (got - expected).abs().max()
            assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_bf16_and_fp32_on_the_cpu_are_packed():
    model = build_model(vocab_size=300, eos_id=1)
    assert can_pack(model, torch.device("cpu"), torch.float32)
    assert not can_pack(model, torch.device("cpu"), torch.float64)
    assert not can_pack(model, torch.device("cuda"), torch.bfloat16)
    assert not can_pack(model, torch.device("cuda"), torch.float32)


def test_a_packed_fp32_model_gives_the_plain_models_logits_to_rounding():
    plain = build_model(vocab_size=300, eos_id=1).to(torch.float32)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed, torch.float32) == 2 * 7 + 1
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.inference_mode():
        for rows in (ids[:, :1], ids):
            expected = plain(input_ids=rows).logits
            got = packed(input_ids=rows).logits
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()
            assert torch.equal(got.argmax(-1), expected.argmax(-1))


async def test_an_fp32_engine_with_packed_weights_answers_as_generate_on_the_plain_model(tiny_spec):
    """The engine's greedy ids equal transformers' generate() on the unpacked fp32 model."""
    loaded = load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))
    assert isinstance(loaded.model.lm_head, PackedLinear)
    plain = AutoModelForCausalLM.from_pretrained(tiny_spec.source, dtype=torch.float32)
    engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4)
    texts = ("The quick brown fox", "Paris is the capital", "Sessions keep their cache between turns.")
    prompts = [loaded.tokenizer(text)["input_ids"] for text in texts]
    try:
        got = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=16, ignore_eos=True) for i, p in enumerate(prompts))
        )
    finally:
        engine.stop()
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == reference_greedy(plain, prompt, 16)


@needs_bf16
def test_the_weights_digest_is_of_the_stored_weights_or_taken_before_packing(tiny_spec, monkeypatch):
    packed = load_model(dataclasses.replace(tiny_spec, dtype="bfloat16"), Path("unused"))
    assert isinstance(packed.model.lm_head, PackedLinear)  # its weight is a packed buffer now, not a parameter
    plain = load_model(tiny_spec, Path("unused"))  # float64: nothing packed
    assert packed.digests is not None
    assert plain.digests is not None
    assert packed.digests.weights == plain.digests.weights  # the files' tensors, whatever they are loaded as
    # Without safetensors files, the loaded parameters are digested: before packing turns linears into buffers.
    monkeypatch.setattr(loader, "weights_digest", lambda directory: None)
    from_parameters = load_model(dataclasses.replace(tiny_spec, dtype="bfloat16"), Path("unused"))
    reference = AutoModelForCausalLM.from_pretrained(tiny_spec.source, dtype=torch.bfloat16)
    assert from_parameters.digests is not None
    assert from_parameters.digests.weights == state_dict_digest(reference)  # a fine-tune of any linear changes it


@needs_bf16
async def test_a_bf16_engine_with_packed_weights_and_the_kernel_answers_as_generate(tiny_spec):
    loaded = load_model(dataclasses.replace(tiny_spec, dtype="bfloat16"), Path("unused"))
    engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4)
    prompts = [loaded.tokenizer(text)["input_ids"] for text in ("The quick brown fox", "Paris is the capital")]
    try:
        got = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=8, ignore_eos=True) for i, p in enumerate(prompts))
        )
    finally:
        engine.stop()
    for prompt, result in zip(prompts, got, strict=True):  # transformers' own attention over the same weights
        assert result.token_ids == reference_greedy(loaded.model, prompt, 8)


def test_a_layers_handle_comes_from_its_model_and_path_and_is_never_shared_while_alive():
    model = build_model(vocab_size=300, eos_id=1).to(torch.float32)
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    pack_linears(first, torch.float32, "m")
    pack_linears(second, torch.float32, "m")
    own = first.lm_head.handle
    assert second.lm_head.handle != own  # the same model loaded twice: each call finds its own weights
    assert first.model.layers[0].mlp.packed_gate_up.handle != own
    del first
    gc.collect()
    third = copy.deepcopy(model)
    pack_linears(third, torch.float32, "m")
    assert third.lm_head.handle == own  # the name's own handle again: a restart's graph finds its layers
    x = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        got = torch.ops.kvserve.packed_linear(x, third.lm_head.handle, third.lm_head.out_features)
        assert torch.equal(got, third.lm_head(x))


def test_a_copied_layer_has_a_handle_of_its_own():
    model = build_model(vocab_size=300, eos_id=1).to(torch.float32)
    pack_linears(model, torch.float32, "copied")
    clone = copy.deepcopy(model)
    assert clone.lm_head.handle != model.lm_head.handle
    x = torch.randn(2, model.config.hidden_size)
    with torch.inference_mode():
        clone.lm_head.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(300, x.shape[1]), 1)
        assert torch.equal(torch.ops.kvserve.packed_linear(x, clone.lm_head.handle, 300), torch.zeros(2, 300))
        assert torch.equal(torch.ops.kvserve.packed_linear(x, model.lm_head.handle, 300), model.lm_head(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_makes_a_rows_product_the_same_whatever_rows_share_its_call(dtype):
    if not can_pack(nn.Linear(1, 1), torch.device("cpu"), dtype):  # no oneDNN bf16 kernels on this CPU
        pytest.skip(f"oneDNN does not take {dtype} here")
    model = nn.Sequential(nn.Linear(96, 160, bias=False), nn.Linear(160, 96)).to(dtype)
    pack_linears(model, dtype, f"invariance-{dtype}")
    ways = batch_invariance(model)  # what this CPU needs, measured: how many layers take each way
    assert ways is not None
    assert sum(ways.values()) == 2
    assert set(ways) <= {"as they are", f"rows padded to {ROW_TILE}", f"{ROW_TILE} rows a call"}
    x = torch.randn(1, 100, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([model(x[:, i : i + 1]) for i in range(100)], 1)
        for rows in (2, 9, 40, 100):  # sizes the probe did not try, too
            assert torch.equal(model(x[:, :rows]), alone[:, :rows]), f"{rows} rows"
        pad_rows(model, 1)
        assert torch.allclose(model(x), alone, atol=1e-2)  # as they come: the same products up to rounding


def test_a_model_with_a_linear_layer_left_unpacked_is_not_made_batch_invariant():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    pack_linears(model, torch.float32, "half")
    model.append(nn.Linear(8, 8))
    assert batch_invariance(model) is None


class RowByRow(PackedLinear):
    """A packed layer that multiplies each row alone, so batch-invariant as it is on any CPU, unless `otherwise`
    says a row of a call is summed another way (1 added: past any rounding)."""

    def otherwise(self, x: torch.Tensor, place: int) -> bool:
        return False

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = [PackedLinear._product(self, x[..., i : i + 1, :]) for i in range(x.shape[-2])]
        return torch.cat([row + 1 if self.otherwise(x, i) else row for i, row in enumerate(rows)], -2)


class ByPlace(RowByRow):
    """A kernel that sums a row by its place in the call (places 8 to 15), whatever the rows beside it."""

    def otherwise(self, x: torch.Tensor, place: int) -> bool:
        return 8 <= place < 16


class OneRowOnSome(RowByRow):
    """A kernel for one-row calls that sums some rows otherwise (a positive first feature), as a rounding
    difference shows on some rows only."""

    def otherwise(self, x: torch.Tensor, place: int) -> bool:
        return x.shape[-2] == 1 and bool(x[..., 0, 0] > 0)


def test_a_shape_one_of_whose_layers_sums_rows_by_their_place_leaves_every_layer_taking_rows_as_they_come():
    # Every way fails for ByPlace, and only the probe's shifted rows show it: row i alone, the first n rows and the
    # rows in the whole call all sit where they did. Its shape's other layer holds as it is, and is probed too.
    model = nn.Sequential(
        RowByRow(nn.Linear(64, 96), "place:0"), RowByRow(nn.Linear(96, 96), "place:1"), ByPlace(nn.Linear(96, 96))
    )
    pad_rows(model, -ROW_TILE)  # as an engine in the mode may have left them
    assert batch_invariance(model) is None
    assert [(m.row_multiple, m.per_tile) for m in model] == [(1, False)] * 3


def test_a_layer_whose_one_row_calls_sum_some_rows_otherwise_gets_its_rows_padded():
    # The probe's first row has a negative first feature: only the rows it also tries alone (the 5th, the last) show
    # the one-row kernel. Padded to 16 rows, a row alone is no one-row call.
    model = nn.Sequential(OneRowOnSome(nn.Linear(96, 64), "one-row:0"), RowByRow(nn.Linear(64, 96), "one-row:1"))
    assert batch_invariance(model) == {"as they are": 1, f"rows padded to {ROW_TILE}": 1}
    assert [(m.row_multiple, m.per_tile) for m in model] == [(ROW_TILE, False), (1, False)]
    x = torch.randn(1, 40, 96, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        alone = torch.cat([model(x[:, i : i + 1]) for i in range(40)], 1)
        assert torch.equal(model(x), alone)


def test_padded_rows_go_as_one_call_or_a_tile_a_call_and_only_the_rows_given_come_back():
    linear = nn.Linear(96, 64)
    layer = PackedLinear(linear, "tiles")
    calls: list[int] = []
    product = layer._product
    layer._product = lambda x: calls.append(x.shape[-2]) or product(x)
    x = torch.randn(1, 40, 96, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = linear(x)
        for multiple, rows, sizes in (
            (1, 40, [40]),
            (ROW_TILE, 5, [16]),
            (ROW_TILE, 32, [32]),
            (ROW_TILE, 40, [48]),
            (-ROW_TILE, 16, [16]),
            (-ROW_TILE, 40, [16, 16, 16]),
            (1, 40, [40]),  # set back: one call of the rows as they come
        ):
            pad_rows(layer, multiple)
            calls.clear()
            got = layer(x[:, :rows])
            assert calls == sizes, (multiple, rows)
            assert got.shape == (1, rows, 64)
            assert torch.allclose(got, expected[:, :rows], atol=1e-5), (multiple, rows)


def test_an_attentions_q_k_v_and_an_mlps_gate_and_up_are_one_product_each_computed_once_per_input():
    plain = build_model(vocab_size=300, eos_id=1).to(torch.float32)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed, torch.float32, "fused") == 2 * 7 + 1  # every linear layer, fused or not
    layer = packed.model.layers[0]
    assert isinstance(layer.self_attn.packed_q_k_v, FusedLinear)
    assert isinstance(layer.mlp.packed_gate_up, FusedLinear)
    assert [type(layer.self_attn.q_proj), type(layer.mlp.up_proj)] == [FusedPart, FusedPart]
    assert type(layer.self_attn.o_proj) is PackedLinear
    assert type(layer.mlp.down_proj) is PackedLinear
    products: list[int] = []
    original = PackedLinear._product
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.inference_mode():
        PackedLinear._product = lambda self, x: products.append(self.out_features) or original(self, x)
        try:
            got = packed(input_ids=ids).logits
        finally:
            PackedLinear._product = original
        expected = plain(input_ids=ids).logits
    q, kv, hidden, inter = 64, 32, 64, 128  # the tiny model's q, k and v, hidden and intermediate sizes
    assert products == [q + 2 * kv, hidden, 2 * inter, hidden] * 2 + [300]  # each fused product once a layer
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


def test_a_fused_part_called_on_another_input_answers_for_that_input():
    attention = nn.Module()
    for name, out in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
        setattr(attention, name, nn.Linear(48, out))
    plain = copy.deepcopy(attention)
    pack_linears(attention, torch.float32, "parts")
    x, y = torch.randn(3, 48), torch.randn(3, 48)
    with torch.inference_mode():
        assert torch.allclose(attention.q_proj(x), plain.q_proj(x), atol=1e-5)
        assert torch.allclose(attention.k_proj(y), plain.k_proj(y), atol=1e-5)  # not x's product: y's
        assert torch.allclose(attention.v_proj(x), plain.v_proj(x), atol=1e-5)
        assert torch.allclose(attention.q_proj(x), plain.q_proj(x), atol=1e-5)  # again on x, after all were read
        assert torch.allclose(attention.q_proj(y), plain.q_proj(y), atol=1e-5)  # q twice without k and v between
        attention.k_proj(y), attention.v_proj(y)
        fused = attention.packed_q_k_v
        assert fused._out is None
        assert fused._input is None
        attention.q_proj(x)
        x.add_(1.0)  # changed in place: q asked again is a new call, not the product held for k and v
        assert torch.allclose(attention.q_proj(x), plain.q_proj(x), atol=1e-5)


def test_siblings_that_differ_are_packed_apart():
    attention = nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj = (
        nn.Linear(48, 32),
        nn.Linear(48, 16, bias=False),
        nn.Linear(48, 16),
    )
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(48, 64), nn.Linear(32, 64)  # another input size
    model = nn.Sequential(attention, mlp)
    assert pack_linears(model, torch.float32, "apart") == 5
    assert all(type(m) is PackedLinear for m in (attention.q_proj, attention.k_proj, mlp.gate_proj, mlp.up_proj))


def test_a_copied_model_has_fused_products_of_its_own():
    model = build_model(vocab_size=300, eos_id=1).to(torch.float32)
    pack_linears(model, torch.float32, "copy-fused")
    clone = copy.deepcopy(model)
    ours, theirs = model.model.layers[0].mlp, clone.model.layers[0].mlp
    assert theirs.packed_gate_up is not ours.packed_gate_up
    assert theirs.up_proj.fused is theirs.packed_gate_up  # a part reads its own model's product
    assert theirs.packed_gate_up.handle != ours.packed_gate_up.handle
    x = torch.randn(2, model.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(theirs.up_proj(x), ours.up_proj(x))


@needs_bf16
@pytest.mark.skipif(not kernels.paged_decode_available(), reason="no kernels built here")
def test_decode_products_send_calls_of_up_to_8_rows_to_bf16_gemv_and_larger_ones_to_onednn(monkeypatch):
    if not torch.ops.kvserve.bf16_gemv_available():
        pytest.skip("no AVX512-BF16 build")
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40))  # 40 outputs: no multiple of 16, stays oneDNN's
    plain = copy.deepcopy(model).to(torch.bfloat16)
    pack_linears(model.to(torch.bfloat16), torch.bfloat16, "gemv")
    assert decode_products(model, True) == 1
    assert model[0].gemv is not None
    assert model[1].gemv is None
    sizes: list[int] = []
    onednn = PackedLinear._product
    monkeypatch.setattr(PackedLinear, "_product", lambda self, x: sizes.append(x.shape[-2]) or onednn(self, x))
    with torch.inference_mode():
        for rows in (1, 8, 9, 40):
            x = torch.randn(1, rows, 64).to(torch.bfloat16)
            sizes.clear()
            got = model[0](x)
            assert sizes == ([] if rows <= GEMV_MAX_ROWS else [rows]), rows
            exact = plain[0](x).double()
            assert ((got.double() - exact).abs() <= exact.abs().clamp(min=1) * 2**-6).all()
        assert decode_products(model, False) == 0
        assert model[0].gemv is None  # off frees the copy: every call is oneDNN's again
        sizes.clear()
        model[0](torch.randn(1, 1, 64).to(torch.bfloat16))
        assert sizes == [1]
