"""/v1/completions and /v1/chat/completions: their bodies as turns of the pipeline (server/serving/pipeline.py)."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from starlette.responses import Response

from server.openai.schemas import ChatCompletionRequest, CompletionRequest
from server.serving import structured
from server.serving.core import Serving, session_key
from server.serving.pipeline import Turn, run_turn
from server.serving.prompts import chat_messages, check_text_size, completion_ids, sampling_params
from server.serving.render.completions import CompletionRenderer
from server.serving.tool_reader import Reading
from server.serving.tools import tool_use
from server.sessions.chat import ChatMessage
from server.sessions.record import Session


class Completions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def completion(self, req: CompletionRequest, http: Request, tenant: str) -> Response:
        """OpenAI's semantics on a session too: the prompt is the whole text; the cached prefix it shares with
        the session's transcript is reused, and the transcript becomes this prompt and its completion."""
        engine = self.serving.engine(req.model)
        loaded = engine.loaded
        key = session_key(req, http, tenant)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            check_text_size(loaded, [prompt], "prompt")
        ids = await asyncio.to_thread(completion_ids, req, loaded)  # tokenizing: off the event loop
        reading = Reading(None, "", "cmpl-" + uuid.uuid4().hex)
        turn = Turn(
            engine, tenant, reading, key, None, req.max_tokens,
            sampling=lambda budget: sampling_params(req, loaded, budget, req.logprobs),
            renderer=lambda _admitted, reader: CompletionRenderer(req, engine, False, reader),
            stream=req.stream, prompt_ids=ids, schema=structured.format_schema(req.response_format),
            use_cache=req.cache_prompt,
        )  # fmt: skip
        return await run_turn(self.serving, turn, http)

    async def chat(self, req: ChatCompletionRequest, http: Request, tenant: str) -> Response:
        engine = self.serving.engine(req.model)
        loaded = engine.loaded
        key = session_key(req, http, tenant)
        view = await self.serving.session_view(key, engine)
        messages = with_session_system(chat_messages(req), view)
        check_text_size(loaded, [m["content"] for m in messages], "messages")
        tools = tool_use(req)
        reading = Reading.of(loaded.tokenizer, tools, "chatcmpl-" + uuid.uuid4().hex, messages)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        turn = Turn(
            engine, tenant, reading, key, messages, req.output_limit(),
            sampling=lambda budget: sampling_params(req, loaded, budget, num_logprobs),
            renderer=lambda _admitted, reader: CompletionRenderer(req, engine, True, reader),
            stream=req.stream, base=view, schema=structured.format_schema(req.response_format),
            use_cache=req.cache_prompt,
        )  # fmt: skip
        return await run_turn(self.serving, turn, http)


def with_session_system(messages: list[ChatMessage], view: Session | None) -> list[ChatMessage]:
    """A session created with a system prompt applies it to requests that bring none of their own."""
    if view is None or not view.turns[0].num_messages or messages[0]["role"] == "system":
        return messages
    return view.messages[: view.turns[0].num_messages] + messages
