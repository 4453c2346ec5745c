"""POST /tokenize and /detokenize: what a prompt is in tokens, with or without the chat template, and back."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import ValidationError

from server.openai.errors import ApiError
from server.openai.formats import DetokenizeRequest, TokenizeRequest
from server.openai.schemas import ChatCompletionRequest
from server.serving import continuation
from server.serving.core import Serving
from server.serving.prompts import chat_messages, check_chat_size, check_text_size, checked_ids
from server.serving.tools import tool_use


class Tokens:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        loaded = self.serving.engine(req.model).loaded
        if req.prompt is not None:
            check_text_size(loaded, [req.prompt], "prompt")

        def body() -> dict[str, Any]:
            """Checking the messages and tools as chat does, rendering, tokenizing and naming the tokens: all off
            the event loop."""
            if req.prompt is not None:
                tokens = list(loaded.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
            else:
                chat = _as_chat(req)
                messages, tools = chat_messages(chat), tool_use(chat)
                check_chat_size(loaded, messages, tools)  # before rendering: a tool's schema may be megabytes
                text = continuation.render(loaded, messages, req.add_generation_prompt, tools)
                tokens = continuation.tokenize(loaded, text)
            found: dict[str, Any] = {"count": len(tokens), "max_model_len": loaded.max_context, "tokens": tokens}
            if req.return_token_strs:
                found["token_strs"] = loaded.tokenizer.convert_ids_to_tokens(tokens)
            return found

        return await asyncio.to_thread(body)

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        loaded = self.serving.engine(req.model).loaded
        checked_ids(req.tokens, loaded.vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(loaded.tokenizer.decode, req.tokens)}


def _as_chat(req: TokenizeRequest) -> ChatCompletionRequest:
    """The messages (and tools) checked exactly as chat completions checks them."""
    try:
        return ChatCompletionRequest(model=req.model, messages=req.messages, tools=req.tools)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "messages"
        raise ApiError(400, "invalid_parameter", f"'{where}': {err['msg']}", where) from exc
