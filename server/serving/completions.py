"""/v1/completions and /v1/chat/completions: their bodies read as turns of the pipeline (server/serving/pipeline.py).

OpenAI's semantics on a session too: the prompt is the whole text or conversation; the cached prefix it shares with
the session's transcript is reused, and the transcript becomes this prompt and its completion.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.openai.schemas import ChatCompletionRequest, CompletionRequest
from server.serving import structured
from server.serving.pipeline import Answer, Arrival, NamedSession, OnNamed, Started, Stateless, Turn, session_key
from server.serving.prompts import chat_messages, sampling_of
from server.serving.render.base import Renderer
from server.serving.render.completions import CompletionRenderer
from server.serving.tool_reader import ToolReader
from server.serving.tools import tool_use


@dataclass(slots=True, frozen=True)
class CompletionAnswer(Answer):
    """Chunks (a chat reply's tool calls read out of its text) or one body, OpenAI's shapes."""

    is_chat: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage

    async def renderer(self, started: Started, reader: ToolReader) -> Renderer:
        return CompletionRenderer(started.engine, self.is_chat, self.include_usage, reader)


def read_completion(req: CompletionRequest, arrival: Arrival) -> Turn:
    return Turn(
        req.model, arrival.tenant, arrival.request_id, session_key(req, arrival), Stateless(), OnNamed(),
        CompletionAnswer(False, _include_usage(req)), prompt=req.single_prompt(),
        sampling=sampling_of(req, req.logprobs), max_tokens=req.max_tokens, stream=req.stream,
        schema=structured.format_schema(req.response_format), text_param="prompt", use_cache=req.cache_prompt,
    )  # fmt: skip


def read_chat(req: ChatCompletionRequest, arrival: Arrival) -> Turn:
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Turn(
        req.model, arrival.tenant, arrival.request_id, session_key(req, arrival), NamedSession(), OnNamed(),
        CompletionAnswer(True, _include_usage(req)), messages=chat_messages(req), tools=tool_use(req),
        sampling=sampling_of(req, num_logprobs), max_tokens=req.output_limit(), stream=req.stream,
        schema=structured.format_schema(req.response_format), use_cache=req.cache_prompt,
    )  # fmt: skip


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
