"""A model's weights counted as they are held: each storage once, by its form (dense, packed for oneDNN, the
bf16_gemv copies); what packing or turning the copies off drops is really gone."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from server.kv import kernels
from server.models.packed_linear import PackedLinear, decode_products, pack_linears
from server.models.weight_bytes import weight_bytes
from tests.tiny import build_model

needs_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no oneDNN bf16 kernels"
)


def tied(dtype: torch.dtype) -> nn.Module:
    model = build_model(vocab_size=320, eos_id=1).to(dtype)
    model.lm_head.weight = model.model.embed_tokens.weight  # as tie_word_embeddings does
    return model


def linears_of(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def linear_bytes(model: nn.Module) -> int:
    return sum(m.in_features * m.out_features * m.weight.element_size() for m in linears_of(model))


def test_an_unpacked_model_holds_its_parameters_and_buffers_each_storage_once():
    model = tied(torch.float64)
    every = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))  # tied: listed once
    assert weight_bytes(model).dense == every
    model.register_buffer("view", model.lm_head.weight.detach()[:10])  # a view of a weight: no bytes of its own
    model.model.norm.weight.data = torch.ones(64 * 4, dtype=torch.float64)[::4]  # a view of a larger storage
    got = weight_bytes(model)
    assert got.dense == every + 3 * 64 * 8  # the whole storage counts
    assert (got.packed, got.gemv) == (0, 0)


@needs_bf16
@pytest.mark.parametrize("is_tied", [False, True])
def test_packing_leaves_no_linear_weight_beside_its_packed_form(is_tied):
    model = tied(torch.bfloat16) if is_tied else build_model(vocab_size=320, eos_id=1).to(torch.bfloat16)
    before = weight_bytes(model).dense
    linears = linear_bytes(model)  # a tied LM head's weight counted here too: it is packed as a copy
    embedding = model.model.embed_tokens.weight.untyped_storage()
    weights = {
        m.weight.untyped_storage().data_ptr(): StorageWeakRef(m.weight.untyped_storage()) for m in linears_of(model)
    }
    assert pack_linears(model, torch.bfloat16, "weights") == 2 * 7 + 1
    gc.collect()
    alive = [address for address, ref in weights.items() if not ref.expired()]
    assert alive == ([embedding.data_ptr()] if is_tied else [])  # the embedding reads its weight; no other is kept
    got = weight_bytes(model)
    shared = embedding.nbytes() if is_tied else 0
    assert got.dense == before - linears + shared  # the embedding and the norms
    assert got.packed == linears
    assert got.gemv == 0


@needs_bf16
@pytest.mark.skipif(not kernels.paged_decode_available(), reason="no kernels built here")
def test_the_bf16_gemv_copies_are_counted_while_on_and_gone_once_off():
    if not torch.ops.kvserve.bf16_gemv_available():
        pytest.skip("no AVX512-BF16 build")
    model = build_model(vocab_size=320, eos_id=1).to(torch.bfloat16)
    pack_linears(model, torch.bfloat16, "copies")
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    packed = weight_bytes(model).packed
    assert decode_products(model, True) == len(layers)  # the tiny model's sizes all fit (vocabulary 320 = 20 x 16)
    copies = [StorageWeakRef(m.gemv.untyped_storage()) for m in layers if m.gemv is not None]
    got = weight_bytes(model)
    assert got.gemv == packed  # the linear weights once more, in the kernel's layout
    assert got.packed == packed
    decode_products(model, False)
    gc.collect()
    assert not any(not ref.expired() for ref in copies)  # no tensor holds their storage any more
    assert weight_bytes(model).gemv == 0
