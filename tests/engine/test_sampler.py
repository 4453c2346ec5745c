"""Sampling transforms on hand-made logits, placed at shuffled token ids so index-mapping bugs show;
and, on the engine, rows that adjust their logits (logit_bias) among rows that take the batched paths."""

from __future__ import annotations

import asyncio

import pytest
import torch

from server.engine.request import SamplingParams
from server.engine.sampler import TOP_P_CANDIDATES, Sampler, _truncate, batch_sample
from tests.helpers import collect, make_engine, paused, reference_greedy, request, run

VALUES = [2.0, 1.5, 1.0, 0.5, -1.0, -3.0]  # by rank: VALUES[r] is the r-th best logit
RANK_TO_ID = [4, 0, 5, 2, 1, 3]  # the token id holding each rank: not sorted, not reversed
LOGITS = torch.empty(6)
LOGITS[RANK_TO_ID] = torch.tensor(VALUES)


def ranked(*ranks: int) -> set[int]:
    return {RANK_TO_ID[r] for r in ranks}


def sampler(prompt_ids: list[int] | None = None, **kw) -> Sampler:
    return Sampler(SamplingParams(**kw), prompt_ids=prompt_ids or [], vocab_size=6, device="cpu")


def draws(s: Sampler, logits: torch.Tensor = LOGITS, n: int = 300) -> set[int]:
    return {s.sample(logits)[0] for _ in range(n)}


def test_greedy_and_logit_bias():
    assert sampler(temperature=0).sample(LOGITS)[0] == RANK_TO_ID[0]
    assert sampler(temperature=0, logit_bias={RANK_TO_ID[3]: 100.0}).sample(LOGITS)[0] == RANK_TO_ID[3]


def test_top_k_top_p_min_p_restrict_the_support():
    assert draws(sampler(temperature=1.0, top_k=2, seed=0)) == ranked(0, 1)
    assert draws(sampler(temperature=1.0, top_p=0.01, seed=0)) == ranked(0)
    # softmax of VALUES: 0.44, 0.27, 0.16, 0.10, 0.02, 0.003. top_p 0.8: the mass before rank 2 is 0.71 < 0.8,
    # before rank 3 it is 0.87 >= 0.8, so ranks 0-2 stay.
    assert draws(sampler(temperature=1.0, top_p=0.8, seed=0)) == ranked(0, 1, 2)
    # min_p 0.5: keep tokens with p >= 0.5 * p(best): exp(-0.5)=0.61 and exp(-1)=0.37
    assert draws(sampler(temperature=1.0, min_p=0.5, seed=0)) == ranked(0, 1)


def test_seed_reproducible_and_independent():
    s1, s2 = sampler(temperature=1.0, seed=7), sampler(temperature=1.0, seed=7)
    seq1 = [s1.sample(LOGITS)[0] for _ in range(30)]
    interleaved = []
    other = sampler(temperature=1.0, seed=8)
    for _ in range(30):
        other.sample(LOGITS)  # another request's draws must not move this one's generator
        interleaved.append(s2.sample(LOGITS)[0])
    assert seq1 == interleaved
    assert len(set(seq1)) > 1  # really sampling


def test_frequency_counts_every_occurrence_presence_only_the_first():
    best, second = RANK_TO_ID[0], RANK_TO_ID[1]  # logits 2.0 and 1.5
    s = sampler(temperature=0, frequency_penalty=0.3)
    s.observe(best)
    s.observe(best)
    assert s.sample(LOGITS)[0] == second  # 2.0 - 2 x 0.3 = 1.4 < 1.5
    s = sampler(temperature=0, presence_penalty=0.3)
    s.observe(best)
    s.observe(best)
    assert s.sample(LOGITS)[0] == best  # 2.0 - 0.3 = 1.7 > 1.5: seen twice, penalised once


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    s = sampler([RANK_TO_ID[0]], temperature=0, repetition_penalty=2.0)
    assert s.sample(LOGITS)[0] == RANK_TO_ID[1]  # prompt token: 2.0 / 2 = 1.0 < 1.5
    logits = torch.full((6,), -5.0)
    logits[3], logits[1] = -0.2, -0.3  # the best two are negative
    s = sampler([3], temperature=0, repetition_penalty=2.0)
    assert s.sample(logits)[0] == 1  # -0.2 x 2 = -0.4 < -0.3 (dividing would give -0.1 and keep token 3)
    assert sampler([], temperature=0, repetition_penalty=2.0).sample(logits)[0] == 3  # unseen: untouched


def test_logprobs_are_of_the_raw_distribution():
    token, lp = sampler(temperature=0, num_logprobs=2, repetition_penalty=1.5).sample(LOGITS)
    expected = torch.log_softmax(LOGITS, -1)
    assert token == RANK_TO_ID[0]
    assert abs(lp.logprob - float(expected[token])) < 1e-6
    assert [t for t, _ in lp.top] == [RANK_TO_ID[0], RANK_TO_ID[1]]
    assert abs(lp.top[1][1] - float(expected[RANK_TO_ID[1]])) < 1e-6


def test_one_batched_draw_honours_each_rows_own_settings():
    settings = [dict(top_k=2), dict(top_p=0.01), dict(top_p=0.8), dict(min_p=0.5), dict(temperature=0.5)]
    samplers = [sampler(seed=i, **kw) for i, kw in enumerate(settings)]
    seen = [set() for _ in settings]
    for _ in range(300):
        for row, token in enumerate(batch_sample(samplers, LOGITS.expand(len(settings), -1))):
            seen[row].add(token)
    assert seen[:4] == [ranked(0, 1), ranked(0), ranked(0, 1, 2), ranked(0, 1)]
    assert ranked(0, 1, 2) <= seen[4]  # temperature alone cuts nothing


def test_a_seeded_row_draws_the_same_alone_and_in_a_batch():
    alone = sampler(temperature=1.0, top_p=0.9, seed=3)
    tokens = [alone.sample(LOGITS)[0] for _ in range(40)]
    batched, other = sampler(temperature=1.0, top_p=0.9, seed=3), sampler(temperature=0.7, top_k=3, seed=4)
    together = [batch_sample([other, batched], LOGITS.expand(2, -1))[1] for _ in range(40)]
    assert together == tokens
    assert len(set(tokens)) > 1


@pytest.mark.parametrize("spread", [0.5, 8.0], ids=["flat", "peaked"])  # flat: top-p needs far more than 64 tokens
def test_top_p_keeps_what_a_full_sort_keeps(spread):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=gen) * spread
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5), SamplingParams(top_p=1.0)]
    probs = torch.softmax(logits, dim=-1)
    kept = _truncate(logits, params) > 0
    for row, p in enumerate(params):
        ordered, order = torch.sort(probs[row], descending=True)
        before = ordered.cumsum(0) - ordered
        expected = torch.zeros(5000, dtype=torch.bool)
        expected[order[before < p.top_p if p.top_p < 1.0 else slice(None)]] = True
        assert torch.equal(kept[row], expected), (row, int(kept[row].sum()), int(expected.sum()))
    # flat: the first look (the 64 most likely) was not enough; peaked: it was
    assert (int(kept[0].sum()) > TOP_P_CANDIDATES) == (spread < 1)


async def test_logit_bias_holds_for_a_row_in_a_batch_and_leaves_the_other_rows_alone(tiny):
    """A greedy and a seeded-sampled row with a bias share steps with plain rows of both kinds (which take
    the batched argmax and draw): each biased row gets its forced token, each plain row what it gets alone."""
    engine = make_engine(tiny, block_size=4)
    try:
        prompt = tiny.tokenizer("The quick brown fox jumps over")["input_ids"]
        expected = reference_greedy(tiny.model, prompt, 6)
        forced_greedy, forced_sampled = [t for t in range(100, 200) if t not in expected and t not in prompt][:2]
        sampled = dict(temperature=1.0, seed=5)
        alone = await run(engine, prompt, max_tokens=6, ignore_eos=True, **sampled)
        rows = {
            "plain-greedy-0": dict(),
            "plain-greedy-1": dict(),
            "biased-greedy": dict(logit_bias={forced_greedy: 100.0}),
            "plain-sampled": sampled,
            "biased-sampled": dict(temperature=1.0, seed=6, logit_bias={forced_sampled: 100.0}),
        }
        before = len(engine.loop.step_log)
        async with paused(engine):  # all five are taken in one go, so they decode in the same steps
            handles = [
                engine.submit(request(prompt, rid=rid, max_tokens=6, ignore_eos=True, **kw)) for rid, kw in rows.items()
            ]
        got = dict(zip(rows, await asyncio.gather(*map(collect, handles)), strict=True))
        steps = list(engine.loop.step_log)[before:]
        assert any(set(step.decode) == set(rows) for step in steps), "the five rows never decoded in one step"
        assert got["biased-greedy"].token_ids == [forced_greedy] * 6
        assert got["biased-sampled"].token_ids == [forced_sampled] * 6
        assert got["plain-greedy-0"].token_ids == got["plain-greedy-1"].token_ids == expected
        assert got["plain-sampled"].token_ids == alone.token_ids
    finally:
        engine.stop()
