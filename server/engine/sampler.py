"""Per-request logits processing and sampling; each request owns its torch.Generator."""

from __future__ import annotations

import random

import torch

from server.engine.request import SamplingParams, TokenLogprob


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
        # Greedy with nothing to adjust or report: the step takes its token from one argmax over the whole batch.
        self.is_plain_greedy = (
            params.is_greedy and not self.is_tracking and self.bias is None and params.num_logprobs is None
        )

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
            probs = torch.softmax(processed, dim=-1)
            token_id = int(torch.multinomial(probs, 1, generator=self.generator))
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
        if p.is_greedy:
            return logits
        logits = logits / p.temperature
        return _truncate(logits, p.top_k, p.top_p, p.min_p)

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
    """The argmax of each of these rows of the step's logits [R, V], in one call."""
    if len(rows) == logits.shape[0]:
        return logits.argmax(dim=-1).tolist()
    return logits[rows].argmax(dim=-1).tolist()


def _truncate(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the best token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _bias_tensor(logit_bias: dict[int, float], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    if not logit_bias:
        return None
    bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    ids = torch.tensor(list(logit_bias.keys()), device=device)
    bias[ids] = torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=device)
    return bias
