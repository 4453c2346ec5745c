"""Shared test helpers: run one request through an engine and collect what it produced."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from server.engine.types import (
    Admitted,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    SessionKey,
    TextDelta,
    Usage,
)


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: Failed | None = None
    logprobs: list = field(default_factory=list)
    admitted: Admitted | None = None


async def run(engine, prompt_ids, session: str | None = None, rid: str = "r", snapshot=None, **params) -> Result:
    params.setdefault("temperature", 0.0)
    key = SessionKey("default", session) if session else None
    request = GenerationRequest(rid, list(prompt_ids), SamplingParams(**params), key, snapshot=snapshot)
    handle = engine.submit(request)
    out = Result()
    async for event in handle:
        if isinstance(event, Admitted):
            out.admitted = event
        elif isinstance(event, TextDelta):
            out.token_ids += event.token_ids
            out.text += event.text
            out.logprobs += event.logprobs or []
        elif isinstance(event, Finished):
            out.finish_reason, out.usage = event.finish_reason, event.usage
        else:
            out.error = event
    return out


def reference_greedy(model, prompt_ids: list[int], num_new: int) -> list[int]:
    """HF generate, greedy, fixed length; asserts no near-tie could flip an argmax on rounding."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    for scores in out.scores:  # raw scores per step, [1, V]
        top2 = torch.topk(scores[0].double(), 2).values
        assert float(top2[0] - top2[1]) > 1e-6, "seed gives a near-tie: pick another"
    return out.sequences[0, len(prompt_ids) :].tolist()
