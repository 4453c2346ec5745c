"""Sampling transforms on hand-made logits."""

from __future__ import annotations

import torch

from server.engine.sampler import Sampler
from server.engine.types import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, -1.0, -3.0])


def sampler(**kw) -> Sampler:
    return Sampler(SamplingParams(**kw), prompt_ids=[], vocab_size=6, device="cpu")


def draws(s: Sampler, n: int = 200) -> set[int]:
    return {s.sample(LOGITS)[0] for _ in range(n)}


def test_greedy_and_logit_bias():
    assert sampler(temperature=0).sample(LOGITS)[0] == 0
    assert sampler(temperature=0, logit_bias={3: 100.0}).sample(LOGITS)[0] == 3


def test_top_k_top_p_min_p_restrict_the_support():
    assert draws(sampler(temperature=1.0, top_k=2, seed=0)) == {0, 1}
    assert draws(sampler(temperature=1.0, top_p=0.01, seed=0)) == {0}
    # min_p 0.5: keep tokens with p >= 0.5 * p(best): exp(-0.5)=0.61 and exp(-1)=0.37
    assert draws(sampler(temperature=1.0, min_p=0.5, seed=0)) == {0, 1}


def test_seed_reproducible_and_independent():
    a = [sampler(temperature=1.0, seed=7).sample(LOGITS)[0] for _ in range(1)]
    s1, s2 = sampler(temperature=1.0, seed=7), sampler(temperature=1.0, seed=7)
    seq1 = [s1.sample(LOGITS)[0] for _ in range(30)]
    interleaved = []
    other = sampler(temperature=1.0, seed=8)
    for _ in range(30):
        other.sample(LOGITS)  # another request's draws must not move this one's generator
        interleaved.append(s2.sample(LOGITS)[0])
    assert seq1 == interleaved and seq1[0] == a[0]


def test_penalties():
    s = sampler(temperature=0, frequency_penalty=2.0)
    s.observe(0)
    assert s.sample(LOGITS)[0] == 1  # 2.0 - 2.0 < 1.5
    s = sampler(temperature=0, presence_penalty=0.6)
    s.observe(0)
    assert s.sample(LOGITS)[0] == 1  # 2.0 - 0.6 < 1.5
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0), [0], 6, "cpu")
    assert s.sample(LOGITS)[0] == 1  # prompt token 0: 2.0 / 2 < 1.5


def test_logprobs_are_of_the_raw_distribution():
    token, lp = sampler(temperature=0, num_logprobs=2).sample(LOGITS)
    expected = torch.log_softmax(LOGITS, -1)
    assert token == 0 and abs(lp.logprob - float(expected[0])) < 1e-6
    assert [t for t, _ in lp.top] == [0, 1]
