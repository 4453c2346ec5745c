"""Heads' kernel layouts kept across steps: by their blocks' stamps, dropped when unused, within a byte limit."""

from __future__ import annotations

import pytest
import torch

from server.kv import kernels
from server.kv.head_layouts import MAX_BYTES, HeadLayouts
from server.kv.pool import KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
BLOCK = 16  # a tile of the layout per block


def layouts(limit_heads_of_blocks: int) -> HeadLayouts:
    """Room for this many blocks of heads."""
    probe = HeadLayouts(LAYOUT, BLOCK, 0)
    return HeadLayouts(LAYOUT, BLOCK, probe.nbytes(limit_heads_of_blocks))


def test_a_step_gets_back_the_layouts_it_kept_and_drops_those_it_no_longer_uses():
    kept = layouts(100)
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    first = kept.for_step([a, b])
    assert all(first)
    assert first[0] is not first[1]
    second = kept.for_step([b, a, a])  # two heads with the same blocks share one layout
    assert second[0] is first[1]
    assert second[1] is first[0]
    assert second[2] is first[0]
    kept.for_step([b])
    assert kept.num_kept == 1
    assert kept.for_step([a])[0] is not first[0]  # dropped at the step that did not use it: made anew
    assert kept.for_step([]) == []
    assert kept.num_kept == 0


def test_new_stamps_of_the_same_blocks_are_a_new_layout():
    """A block handed out again, or cut, has a new stamp: its old layout is never served for it."""
    kept = layouts(100)
    (old,) = kept.for_step([(1, 2, 3)])
    (new,) = kept.for_step([(1, 2, 9)])
    assert new is not old


def test_layouts_fit_the_limit_and_the_kept_ones_stay_first():
    kept = layouts(8)
    a, b, c = (1, 2, 3, 4, 5), (6, 7, 8), (9, 10, 11, 12)
    got = kept.for_step([a, b])
    assert got[0] is not None
    assert got[1] is not None
    later = kept.for_step([c, b, a])  # c is new and does not fit beside the kept a and b
    assert later[0] is None
    assert later[1] is got[1]
    assert later[2] is got[0]


def test_the_limit_is_a_quarter_of_the_pool_at_most_256_mib():
    assert HeadLayouts.for_pool(LAYOUT, BLOCK, 1 << 20).limit_bytes == 1 << 18
    assert HeadLayouts.for_pool(LAYOUT, BLOCK, 64 << 30).limit_bytes == MAX_BYTES


@pytest.mark.skipif(not kernels.paged_prefill_available(torch.bfloat16, 64), reason="no AVX512-BF16 build")
def test_a_layer_is_laid_out_once_and_its_size_is_what_the_limit_counts():
    kept = layouts(100)
    pool_k = [torch.randn(2, 8 * BLOCK, 64).to(torch.bfloat16) for _ in range(3)]
    pool_v = [torch.randn(2, 8 * BLOCK, 64).to(torch.bfloat16) for _ in range(3)]
    blocks = torch.tensor([7, 2, 5], dtype=torch.int32)
    (head,) = kept.for_step([(11, 12, 13)])
    assert head is not None
    made = [head.of_layer(layer, pool_k[layer], pool_v[layer], blocks, 3 * BLOCK) for layer in range(3)]
    assert kept.num_made == 3
    again = head.of_layer(1, pool_k[1], pool_v[1], blocks, 3 * BLOCK)
    assert kept.num_made == 3
    assert again is made[1]
    assert sum(t.nbytes for pair in made for t in pair) == kept.nbytes(3)


@pytest.mark.skipif(not kernels.paged_prefill_available(torch.bfloat16, 64), reason="no AVX512-BF16 build")
def test_what_the_kept_layouts_hold_is_counted_as_they_are_made_and_gone_with_them():
    kept = layouts(100)
    pool_k = [torch.randn(2, 8 * BLOCK, 64).to(torch.bfloat16) for _ in range(3)]
    pool_v = [torch.randn(2, 8 * BLOCK, 64).to(torch.bfloat16) for _ in range(3)]
    blocks = torch.tensor([7, 2, 5], dtype=torch.int32)
    (head,) = kept.for_step([(11, 12, 13)])
    assert head is not None
    assert kept.kept_bytes == 0  # a head's layers are laid out by their first call
    made = [head.of_layer(layer, pool_k[layer], pool_v[layer], blocks, 3 * BLOCK) for layer in range(2)]
    assert kept.kept_bytes == sum(t.untyped_storage().nbytes() for pair in made for t in pair) > 0
    kept.for_step([])  # a step without it drops it
    assert kept.kept_bytes == 0
