"""kvserve::bf16_gemv, the decode steps' linear products: against float64 products of the same bf16 values, a row's
result whatever rows share its call, and the calls it refuses."""

from __future__ import annotations

import pytest
import torch

from server.kv import kernels

pytestmark = pytest.mark.skipif(
    not (kernels.paged_decode_available() and torch.ops.kvserve.bf16_gemv_available()),
    reason="no AVX512-BF16 build: decode steps' products stay oneDNN's",
)


def operands(
    rows: int, k: int, n: int, seed: int, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("k", "n"), [(64, 16), (70, 48), (576, 960), (1536, 64)])  # 70: an odd number of pairs
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_float64_one_rounded_to_bf16(rows, k, n, bias):
    x, w, b = operands(rows, k, n, seed=rows * 1000 + k + n, bias=bias)
    got = torch.ops.kvserve.bf16_gemv(x, torch.ops.kvserve.bf16_gemv_pack(w), b)
    assert got.shape == (1, rows, n)
    assert got.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    # fp32 sums in another order than float64's, then one rounding to bf16: within a bf16 step of the exact value
    step = exact.abs().clamp(min=1.0) * 2**-7
    assert ((got.double() - exact).abs() <= step).all(), (got.double() - exact).abs().max()
    assert (got == exact.to(torch.bfloat16)).double().mean() > 0.9  # mostly the exact value's own rounding


def test_a_rows_product_is_the_same_whatever_rows_share_its_call():
    x, w, b = operands(8, 576, 960, seed=5, bias=True)
    packed = torch.ops.kvserve.bf16_gemv_pack(w)
    whole = torch.ops.kvserve.bf16_gemv(x, packed, b)
    for i in range(8):
        assert torch.equal(torch.ops.kvserve.bf16_gemv(x[:, i : i + 1], packed, b), whole[:, i : i + 1]), i
    assert torch.equal(torch.ops.kvserve.bf16_gemv(x[:, 3:6], packed, b), whole[:, 3:6])


def test_the_packed_layout_is_16_outputs_a_block_pairs_of_inputs_inner():
    w = torch.arange(32 * 4, dtype=torch.float32).reshape(32, 4).to(torch.bfloat16)  # w[n, k] = 4n + k
    packed = torch.ops.kvserve.bf16_gemv_pack(w)
    assert packed.shape == (2, 2, 16, 2)  # blocks of outputs, pairs of inputs, outputs in a block, the pair
    assert packed[1, 0, 3].tolist() == [4 * 19, 4 * 19 + 1]  # output 16 + 3, inputs 0 and 1
    assert packed[0, 1, 5].tolist() == [4 * 5 + 2, 4 * 5 + 3]  # output 5, inputs 2 and 3


@pytest.mark.parametrize(
    ("rows", "k", "n", "message"),
    [
        (9, 64, 16, "1 to 8 rows"),
        (0, 64, 16, "1 to 8 rows"),
        (1, 32, 16, "x's last size"),
    ],
)
def test_what_it_refuses(rows, k, n, message):
    w = torch.randn(n, 64).to(torch.bfloat16)
    x = torch.randn(1, rows, k).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvserve.bf16_gemv(x, torch.ops.kvserve.bf16_gemv_pack(w), None)


def test_a_weight_it_cannot_lay_out_is_refused():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.kvserve.bf16_gemv_pack(torch.randn(24, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.kvserve.bf16_gemv_pack(torch.randn(16, 63).to(torch.bfloat16))
