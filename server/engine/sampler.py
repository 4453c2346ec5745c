"""Logits processing and sampling: each request owns its torch.Generator; plain rows of a step go together.

Truncation (temperature, top-k, min-p, top-p) works on [R, V] with per-row parameters, and a row's
token is drawn by inverting its CDF at one uniform number from the row's own generator. A step's
greedy rows with nothing to adjust take one argmax (`batch_greedy`), its sampled rows with nothing
to adjust one pass of truncation and draw (`batch_sample`); the others (penalties, logit bias,
logprobs) go one by one through the same functions, so a seeded request draws the same tokens
alone as in any batch.
"""

from __future__ import annotations

import random

import torch

from server.engine.request import SamplingParams, TokenLogprob

TOP_P_CANDIDATES = 64  # top-p looks at this many of a row's most likely tokens first


class Sampler:
    """Holds one request's sampling state: its generator and the output-token counts for penalties."""

    def __init__(
        self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device: torch.device | str
    ) -> None:
        self.params = params
        self.device = device
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.is_tracking = (
            params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        )
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if prompt_ids and self.is_tracking:
            self.seen[torch.tensor(prompt_ids, device=device)] = True
        self.bias = _bias_tensor(params.logit_bias, vocab_size, device)
        # Nothing to adjust or report: the step takes such rows' tokens together (one argmax, or one draw pass).
        is_plain = not self.is_tracking and self.bias is None and params.num_logprobs is None
        self.is_plain_greedy = is_plain and params.is_greedy
        self.is_plain_sampled = is_plain and not params.is_greedy

    def observe(self, token_id: int) -> None:
        if self.is_tracking:  # penalties need counts; skip the tensor writes otherwise
            self.output_counts[token_id] += 1
            self.seen[token_id] = True

    def sample(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """logits: [V] of the last position. Returns the token and, if asked, its logprobs."""
        logits = logits.float()
        processed = self._process(logits)
        if self.params.is_greedy:
            token_id = int(torch.argmax(processed))
        else:
            token_id = _draw(_truncate(processed[None], [self.params]), [self])[0]
        return token_id, self._logprobs(logits, token_id)

    def _process(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if self.bias is not None:
            logits = logits + self.bias
        if p.repetition_penalty != 1.0:
            penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self.seen, penalised, logits)
        if p.frequency_penalty or p.presence_penalty:
            logits = logits - p.frequency_penalty * self.output_counts
            logits = logits - p.presence_penalty * (self.output_counts > 0).float()
        return logits

    def _logprobs(self, logits: torch.Tensor, token_id: int) -> TokenLogprob | None:
        # Logprobs of the model's own distribution (before penalties and temperature), as vLLM reports.
        k = self.params.num_logprobs
        if k is None:
            return None
        logprobs = torch.log_softmax(logits, dim=-1)
        top: list[tuple[int, float]] = []
        if k > 0:
            values, ids = torch.topk(logprobs, k)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token_id, float(logprobs[token_id]), top)


def batch_greedy(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """The argmax of each of these rows of the step's logits [R, V], in one call.

    In float32: bf16 to float32 is exact (the same argmax, ties to the same first index), and torch's argmax
    over bf16 is not vectorised on the CPU: 735 us for 8 rows of the default model's vocabulary, 149 us this way.
    """
    picked = logits if len(rows) == logits.shape[0] else logits[rows]
    return picked.float().argmax(dim=-1).tolist()


def batch_sample(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """The tokens of rows that sample with nothing to adjust: logits [R, V], one row per sampler, in one pass."""
    return _draw(_truncate(logits.float(), [s.params for s in samplers]), samplers)


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] -> probabilities [R, V] after temperature, top-k, min-p and top-p (each row its own)."""
    device = logits.device

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    vocab = logits.shape[-1]
    logits = logits / column([p.temperature for p in params])
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):  # keep each row's k best (ties with the k-th stay); k = 0 keeps all
        best = torch.topk(logits, max(top_k), dim=-1).values
        kth = best.gather(1, torch.tensor([max(k - 1, 0) for k in top_k], device=device)[:, None])
        kth = kth.masked_fill(column([float(k == 0) for k in top_k]).bool(), float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):  # keep tokens at least min_p times as likely as the best
        floor = column([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if any(p.top_p < 1.0 for p in params):
        probs = _top_p(probs, column([p.top_p for p in params]))
    return probs


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop a token when the mass of the tokens before it (most likely first) already reaches top_p.

    The best token always stays. Sorting the whole vocabulary costs milliseconds a row, so the k most
    likely tokens come first (topk); once their mass reaches top_p in every row, every token past them is
    dropped anyway, and the answer is the full sort's. Otherwise k grows, up to the vocabulary.
    """
    vocab = probs.shape[-1]
    applies = top_p < 1.0  # [R, 1]: rows with top_p = 1 keep everything, rounding aside
    total = probs.sum(dim=-1, keepdim=True)
    k = min(vocab, TOP_P_CANDIDATES)
    while True:
        best, order = torch.topk(probs, k, dim=-1)  # sorted, most likely first
        mass = best / total
        before = mass.cumsum(dim=-1) - mass
        if k == vocab or bool(((before[:, -1:] + mass[:, -1:] >= top_p) | ~applies).all()):
            break
        k = min(vocab, k * 8)
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, before < top_p)
    return probs.masked_fill(~(kept | ~applies), 0.0)


def _draw(probs: torch.Tensor, samplers: list[Sampler]) -> list[int]:
    """One token per row of probs [R, V] (not normalised), at a uniform number from each row's generator.

    The uniform u is below 1 by at least 2^-24 (float32), so u times the row's total lies below the CDF's
    last value in float64: the first position whose CDF exceeds it is a token that can be drawn.
    """
    uniform = torch.cat([torch.rand(1, generator=s.generator, device=probs.device) for s in samplers])
    cdf = probs.to(torch.float64)
    cdf.cumsum_(dim=-1)
    ids = torch.searchsorted(cdf, (uniform.to(torch.float64) * cdf[:, -1])[:, None], right=True)[:, 0]
    return ids.clamp_(max=probs.shape[-1] - 1).tolist()


def _bias_tensor(logit_bias: dict[int, float], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    if not logit_bias:
        return None
    bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    ids = torch.tensor(list(logit_bias.keys()), device=device)
    bias[ids] = torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=device)
    return bias
