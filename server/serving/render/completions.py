"""Chat completions and completions on the wire: one JSON body, or an SSE stream of chunks ending in [DONE]."""

from __future__ import annotations

import json
import time
from functools import lru_cache
from typing import Any

from sse_starlette import ServerSentEvent

from server.engine.engine import Engine
from server.engine.request import Failed, Finished, TextDelta, TokenLogprob
from server.openai import chunks
from server.serving.render.base import Renderer
from server.serving.tool_reader import ToolReader
from server.sessions.chat import ToolCall


class CompletionRenderer(Renderer):
    """One completion's chunks (a chat reply's tool calls read out of its text), or its response body."""

    def __init__(self, engine: Engine, is_chat: bool, include_usage: bool, reader: ToolReader) -> None:
        self.meta = chunks.Meta(reader.request_id, int(time.time()), engine.model_id, is_chat)
        self.reader, self.include_usage = reader, include_usage
        tokenizer = engine.loaded.tokenizer  # token_text: a token's text (for logprobs), cached for the request
        self.token_text = lru_cache(maxsize=4096)(lambda token_id: str(tokenizer.decode([token_id])))
        self.offset = 0  # the text sent so far, in characters (the logprobs' text offsets)

    async def body(self, finished: Finished, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        lp = chunks.choice_logprobs(self.meta, logprobs if logprobs else None, self.token_text, 0)
        message = self.reader.read_all(text)  # the content as the session records it
        content, calls = message["content"], message.get("tool_calls")
        return chunks.full_response(self.meta, content, finished.finish_reason, finished.usage, lp, calls)

    def opening(self) -> list[ServerSentEvent]:
        return [_data(chunks.delta_chunk(self.meta, "", role=True))] if self.meta.is_chat else []

    def delta(self, event: TextDelta) -> list[ServerSentEvent]:
        text, calls = self.reader.feed(event.text)
        lp = chunks.choice_logprobs(self.meta, event.logprobs, self.token_text, self.offset)
        self.offset += len(text)
        out = [_data(chunks.delta_chunk(self.meta, text, logprobs=lp))] if text or lp is not None else []
        return out + self._calls(calls)

    async def finished(self, event: Finished) -> list[ServerSentEvent]:
        meta = self.meta
        text, calls = self.reader.finish()
        out = [_data(chunks.delta_chunk(meta, text))] if text else []
        out += self._calls(calls)
        finish = chunks.finish_reason_of(event.finish_reason, self.reader.calls)
        out.append(_data(chunks.delta_chunk(meta, None if meta.is_chat else "", finish)))
        if self.include_usage:
            out.append(_data(chunks.usage_chunk(meta, event.usage)))
        return out

    def failed(self, event: Failed) -> list[ServerSentEvent]:
        return [_data(self.error(event)[0])]

    def closing(self) -> list[ServerSentEvent]:
        return [ServerSentEvent(data="[DONE]", sep="\n")]

    def _calls(self, calls: list[ToolCall]) -> list[ServerSentEvent]:
        first = len(self.reader.calls) - len(calls)
        return [_data(chunk) for chunk in chunks.tool_call_chunks(self.meta, calls, first)]


def _data(obj: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(obj, separators=(",", ":"), ensure_ascii=False), sep="\n")
