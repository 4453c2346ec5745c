"""Token-exact chat continuation: a session's next prompt is its transcript plus the new messages.

Re-rendering the whole conversation through the chat template does not give back the
tokens the model saw: templates rewrite earlier turns (strip reasoning, trim whitespace),
insert defaults (SmolLM2 adds a system prompt when none is given), and a reply tokenizes
differently once it is text. So when a request's messages extend the ones a session has
seen, the transcript ids are kept as they are and only the new messages are rendered.

To render just the new messages in their real context, the whole conversation is rendered
with the seen messages' contents replaced by inert placeholders (rewriting that works on
content, like stripping reasoning, leaves them alone), and the new text is what follows the
last placeholder, less the part of that message's closing the transcript already holds.
When the history was edited, or the template defeats this (it rewrote a placeholder), the
caller falls back to a full render and the engine reuses the longest common prefix.
"""

from __future__ import annotations

from typing import Any

from server.models.loader import LoadedModel
from server.openai.errors import ApiError
from server.serving import control_text
from server.serving.prompts import check_chat_size
from server.serving.tools import ToolUse, chat_template, for_template, tool_format
from server.sessions.chat import ChatMessage
from server.sessions.record import Session

PLACEHOLDER = "kvserve-seen-message-{}"


def render(
    loaded: LoadedModel, messages: list[ChatMessage], add_generation_prompt: bool, tools: ToolUse | None = None
) -> str:
    tokenizer = loaded.tokenizer
    template = chat_template(tokenizer, tools)
    if not template:
        raise ApiError(400, "invalid_parameter", f"model {loaded.spec.id!r} has no chat template", "messages")
    shown, definitions = for_template(messages, tools, tool_format(template))
    if loaded.guards_control_text:  # what the client sent never spells a control token (control_text.py)
        shown, definitions = control_text.mark(tokenizer, shown), control_text.mark(tokenizer, definitions)
    extra: dict[str, Any] = {"tools": definitions} if definitions else {}
    try:
        text: str = tokenizer.apply_chat_template(
            shown, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the caller's to fix
        raise ApiError(400, "invalid_parameter", f"chat template rejected the messages: {exc}", "messages") from exc
    return text


def tokenize(loaded: LoadedModel, text: str) -> list[int]:
    """Rendered text's ids. The template writes the special tokens itself (adding BOS again would change the
    prompt); a control token spelt in a message was marked by `render` and comes out as plain text."""
    return control_text.tokenize(loaded.tokenizer, text)


def prompt_ids(
    loaded: LoadedModel, messages: list[ChatMessage], session: Session | None, tools: ToolUse | None = None
) -> list[int]:
    """The prompt for `messages`: the session's transcript + the new messages when they extend it. A conversation
    whose text cannot fit the context is refused first, never rendered."""
    check_chat_size(loaded, messages, tools)
    if session is not None:
        ids = continued_ids(loaded, messages, session, tools)
        if ids is not None:
            return ids
    return tokenize(loaded, render(loaded, messages, add_generation_prompt=True, tools=tools))


def continued_ids(
    loaded: LoadedModel, messages: list[ChatMessage], session: Session, tools: ToolUse | None = None
) -> list[int] | None:
    seen, transcript = session.messages, session.transcript_ids
    if not seen or not transcript or len(messages) <= len(seen) or messages[: len(seen)] != seen:
        return None  # nothing seen, or the history was edited: longest common prefix instead
    if session.tools != (tools.definitions() if tools is not None and tools.specs else None):
        return None  # other tools: the prompt's tool section differs from the transcript's
    # A seen message's whole rendering (its calls included) is in the transcript: only its place is needed.
    placeholders = [_placeholder(m, i) for i, m in enumerate(seen)]
    last = placeholders[-1]["content"]
    full = render(loaded, placeholders + messages[len(seen) :], add_generation_prompt=True, tools=tools)
    if full.count(last) != 1:
        return None  # the template rewrote the placeholder itself: no safe place to cut
    new_text = full[full.index(last) + len(last) :]  # the last seen message's closing, then the new messages
    held = _held_closing(loaded, placeholders, transcript, tools)
    if not new_text.startswith(held):
        return None
    return transcript + tokenize(loaded, new_text[len(held) :])


def _placeholder(message: ChatMessage, index: int) -> ChatMessage:
    """A seen message with its content (and an assistant's calls) replaced by an inert mark."""
    placeholder = message.copy()
    placeholder.pop("tool_calls", None)
    placeholder["content"] = PLACEHOLDER.format(index)
    return placeholder


def _held_closing(
    loaded: LoadedModel, placeholders: list[ChatMessage], transcript: list[int], tools: ToolUse | None
) -> str:
    """The part of the last seen message's closing the transcript already holds.

    A system prompt prefilled at creation holds all of it ('<|im_end|>\n'). A generated reply
    holds its end-of-turn token when it stopped on one, not the newline the template adds
    after it; a reply cut by max_tokens or a stop string holds none of the closing.
    """
    last = placeholders[-1]["content"]
    if placeholders[-1]["role"] != "assistant":  # not a generated reply
        alone = render(loaded, placeholders, add_generation_prompt=False, tools=tools)
        return alone[alone.index(last) + len(last) :] if last in alone else "\0"  # "\0": no match, fall back
    if transcript[-1] in loaded.eos_ids:
        closing: str = loaded.tokenizer.decode([transcript[-1]])
        return closing
    return ""
