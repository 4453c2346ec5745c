"""The Messages API on the wire: the message object, or Anthropic's stream of events."""

from __future__ import annotations

import json
from typing import Any

from sse_starlette import ServerSentEvent

from server.anthropic.answers import (
    content_blocks,
    error_envelope,
    event,
    message_object,
    stop_reason,
    tool_input,
    usage,
)
from server.engine.request import Admitted, Failed, Finished, TokenLogprob
from server.openai.errors import CODE_STATUS
from server.serving.render.base import PartsRenderer
from server.serving.tool_reader import ToolReader
from server.sessions.chat import ToolCall


class MessageRenderer(PartsRenderer):
    """One Messages API reply: the message object, or Anthropic's events (content blocks opened as they come)."""

    def __init__(
        self, message_id: str, model: str, reader: ToolReader, num_marked: int, admitted: Admitted, ttl_s: float | None
    ) -> None:
        """`num_marked`: prompt tokens up to the last cache_control breakpoint (computed ones were cached now; no
        more than the prompt's), kept for `ttl_s` (its ttl)."""
        super().__init__(reader)
        self.message_id, self.model = message_id, model
        self.num_prompt, self.num_cached = admitted.num_prompt, admitted.num_cached
        self.num_created = max(0, min(num_marked, admitted.num_prompt) - admitted.num_cached)
        self.is_hour = ttl_s is not None and ttl_s >= 3600

    def _usage(self, num_output: int) -> dict[str, Any]:
        return usage(self.num_prompt, self.num_cached, self.num_created, num_output, self.is_hour)

    async def body(self, finished: Finished, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        message = self.reader.read_all(text)
        content, calls = message["content"], message.get("tool_calls", [])
        reason = stop_reason(finished.finish_reason, finished.stop_sequence, bool(calls))
        return message_object(
            self.message_id, self.model, content_blocks(content, calls), stop_reason=reason,
            stop_sequence=finished.stop_sequence, usage=self._usage(finished.usage.completion_tokens),
        )  # fmt: skip

    def error(self, failed: Failed) -> tuple[dict[str, Any], int]:
        status = CODE_STATUS.get(failed.code, 500)
        return error_envelope(status, failed.code, failed.message), status

    def opening(self) -> list[ServerSentEvent]:
        start = message_object(self.message_id, self.model, [], usage=self._usage(0))
        return [event("message_start", message=start)]

    async def finished(self, item: Finished) -> list[ServerSentEvent]:
        out = self.rest()
        reason = stop_reason(item.finish_reason, item.stop_sequence, bool(self.num_calls))
        delta = {"stop_reason": reason, "stop_sequence": item.stop_sequence}
        # The whole usage, as Anthropic sends it here: clients that read usage only from this event (LangChain's
        # ChatAnthropic.stream) would otherwise show no input and no cache reads.
        out.append(event("message_delta", delta=delta, usage=self._usage(item.usage.completion_tokens)))
        out.append(event("message_stop"))
        return out

    def failed(self, item: Failed) -> list[ServerSentEvent]:
        return [event("error", error=self.error(item)[0]["error"])]

    def _text_opened(self) -> list[ServerSentEvent]:
        return [event("content_block_start", index=0, content_block={"type": "text", "text": ""})]

    def _text(self, text: str) -> list[ServerSentEvent]:
        return [event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})]

    def _text_closed(self) -> list[ServerSentEvent]:
        """The text block's end (an empty reply has no block at all, as in the answer's JSON)."""
        return [event("content_block_stop", index=0)]

    def _call(self, call: ToolCall, index: int, position: int, is_cut: bool) -> list[ServerSentEvent]:
        """One delta with the whole input (of a call cut short, what of it is whole: the answer's JSON agrees)."""
        function = call["function"]
        start = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input(function["arguments"]))}
        return [
            event("content_block_start", index=position, content_block=start),
            event("content_block_delta", index=position, delta=delta),
            event("content_block_stop", index=position),
        ]
