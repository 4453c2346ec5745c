"""Forward passes as small functions: prefill a span of tokens, decode one token."""

from __future__ import annotations

import inspect

import torch


class ForwardCounter:
    """Tokens fed to the model, by phase: the proof behind `cached_tokens` in tests."""

    __slots__ = ("num_prefill_tokens", "num_decode_tokens", "num_forwards")

    def __init__(self) -> None:
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_forwards = 0


def cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.2x; use what this model's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class Forward:
    """Runs one sequence's forward passes with its own cache; logits only for the last position."""

    def __init__(self, model, counter: ForwardCounter) -> None:
        self.model = model
        self.device = model.device
        self.counter = counter
        self._cache_kw = cache_kwarg(model)

    @torch.inference_mode()
    def __call__(self, token_ids: list[int], cache, start_pos: int, is_prefill: bool) -> torch.Tensor:
        """Feed `token_ids` at positions start_pos.. ; returns the last position's logits [V]."""
        num = len(token_ids)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, T]
        positions = torch.arange(start_pos, start_pos + num, device=self.device).unsqueeze(0)  # [1, T]
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        if is_prefill:
            self.counter.num_prefill_tokens += num
        else:
            self.counter.num_decode_tokens += num
        self.counter.num_forwards += 1
        return out.logits[0, -1]  # [V]
