"""From a validated request to prompt ids and sampling parameters, with the context-length rule."""

from __future__ import annotations

import json
import re

from server.engine.request import SamplingParams
from server.models.loader import LoadedModel
from server.openai.errors import ApiError
from server.openai.schemas import ChatCompletionRequest, SamplingFields
from server.openai.schemas import ChatMessage as RequestMessage
from server.serving.tools import ToolUse, content_beside_calls, tool_call
from server.sessions.chat import ChatMessage
from server.settings import Settings


def check_text_size(loaded: LoadedModel, texts: list[str], param: str) -> None:
    """A prompt whose text alone must exceed the context is refused by its size, before any tokenizing:
    no token covers more than `max_token_bytes` bytes, so bytes / max_token_bytes tokens at least."""
    num_bytes = sum(len(text.encode()) for text in texts)
    at_least = num_bytes // loaded.max_token_bytes
    if at_least > loaded.max_context:
        message = (
            f"this model's context is {loaded.max_context} tokens; {num_bytes} bytes of text are at least "
            f"{at_least} tokens"
        )
        raise ApiError(400, "context_length_exceeded", message, param)


def check_chat_size(loaded: LoadedModel, messages: list[ChatMessage], tools: ToolUse | None) -> None:
    """The size rule for a whole conversation, before its template is rendered (on a worker thread: a tool's
    schema may be megabytes): the contents, the tool calls' arguments and the tool definitions are all text
    the prompt holds."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    texts += [call["function"]["arguments"] for m in messages for call in m.get("tool_calls") or []]
    check_text_size(loaded, texts, "messages")
    if tools is not None and tools.specs:
        definitions = json.dumps(tools.definitions(), ensure_ascii=False, separators=(",", ":"))
        check_text_size(loaded, [*texts, definitions], "tools")


def completion_ids(prompt: str | list[int], loaded: LoadedModel) -> list[int]:
    if isinstance(prompt, str):
        ids: list[int] = loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = checked_ids(list(prompt), loaded.vocab_size, "prompt")
    if not ids:
        raise ApiError(400, "invalid_parameter", "the prompt has no tokens", "prompt")
    return ids


def chat_messages(req: ChatCompletionRequest) -> list[ChatMessage]:
    return [_message(m) for m in req.messages]


def _message(message: RequestMessage) -> ChatMessage:
    """One normal form for a message, whoever sent it: a session's record of its reply and a client's echo of
    that reply compare equal (content "" for null; tool call arguments as compact JSON)."""
    out: ChatMessage = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["content"] = content_beside_calls(out["content"])
        out["tool_calls"] = [tool_call(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    return out


def sampling_of(req: SamplingFields, num_logprobs: int | None) -> SamplingParams:
    """Chat and completions' sampling fields (max_tokens set by the pipeline from the output budget); token ids
    are checked against the model's vocabulary by `checked_sampling`."""
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req),
        seed=req.seed,
        num_logprobs=num_logprobs,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
    )


def checked_sampling(params: SamplingParams, loaded: LoadedModel) -> SamplingParams:
    """`params` when every token id it names is in the model's vocabulary, else a 400 naming the field."""
    checked_ids(list(params.logit_bias), loaded.vocab_size, "logit_bias")
    checked_ids(params.stop_token_ids, loaded.vocab_size, "stop_token_ids")
    return params


def output_budget(loaded: LoadedModel, num_prompt: int, max_tokens: int | None, settings: Settings) -> int:
    """The request's max_tokens, or the default cut to the context; 400 when the context cannot hold it.

    An explicit 0 (Anthropic's prefill-only request: compute and cache the prompt) needs room for the prompt
    alone; a default needs room for one token at least."""
    max_context, limit = loaded.max_context, settings.max_tokens_limit
    if max_tokens is not None and max_tokens > limit:
        raise ApiError(400, "invalid_parameter", f"max_tokens is at most {limit} on this server", "max_tokens")
    is_prefill_only = max_tokens == 0
    if max_tokens is None:
        max_tokens = min(settings.default_max_tokens, max_context - num_prompt, limit)
    if num_prompt + max_tokens > max_context or (max_tokens < 1 and not is_prefill_only):
        raise ApiError(
            400,
            "context_length_exceeded",
            f"this model's context is {max_context} tokens; the prompt has {num_prompt} "
            f"and max_tokens asks for {max(max_tokens, 0)} more",
            "max_tokens" if num_prompt < max_context else "messages",
        )
    return max_tokens


def _logit_bias(req: SamplingFields) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not re.fullmatch(r"-?[0-9]{1,9}", key):
            raise ApiError(400, "invalid_parameter", "logit_bias keys must be token ids", "logit_bias")
        bias[int(key)] = value
    return bias


def checked_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """Token ids in the model's vocabulary, else a 400 naming `param`."""
    if any(not 0 <= t < vocab_size for t in ids):
        raise ApiError(400, "invalid_parameter", f"token ids must be in [0, {vocab_size})", param)
    return ids
