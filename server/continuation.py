"""Token-exact chat continuation: a session's next prompt is its transcript plus the new messages.

Re-rendering the whole conversation through the chat template does not give back the
tokens the model saw: templates rewrite earlier turns (strip reasoning, trim whitespace),
insert defaults (SmolLM2 adds a system prompt when none is given), and a reply tokenizes
differently once it is text. So when a request's messages extend the ones a session has
seen, the transcript ids are kept as they are and only the new messages are rendered.

To render just the new messages in their real context, the seen messages are replaced by
inert placeholders: a template's rewriting (which works on content) then leaves them alone,
and the new messages' text is what the template adds after them. When the history was
edited, or the template renders differently than this assumes, the caller falls back to a
full render and the engine reuses the longest common prefix.
"""

from __future__ import annotations

from server.engine.registry import LoadedModel
from server.engine.session import Entry
from server.errors import ApiError

PLACEHOLDER = "kvserve-seen-message-{}"


def render(loaded: LoadedModel, messages: list[dict], add_generation_prompt: bool) -> str:
    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "invalid_parameter", f"model {loaded.spec.id!r} has no chat template", "messages")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as exc:  # template errors (e.g. roles that must alternate) are the caller's to fix
        raise ApiError(400, "invalid_parameter", f"chat template rejected the messages: {exc}", "messages") from exc


def tokenize(loaded: LoadedModel, text: str) -> list[int]:
    # The template writes the special tokens itself; adding BOS again would change the prompt.
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(loaded: LoadedModel, messages: list[dict], session: Entry | None) -> list[int]:
    """The prompt for `messages`: the session's transcript + the new messages when they extend it."""
    if session is not None:
        ids = continued_ids(loaded, messages, session)
        if ids is not None:
            return ids
    return tokenize(loaded, render(loaded, messages, add_generation_prompt=True))


def continued_ids(loaded: LoadedModel, messages: list[dict], session: Entry) -> list[int] | None:
    seen = session.messages
    if not seen or not session.transcript_ids or len(messages) <= len(seen) or messages[: len(seen)] != seen:
        return None  # nothing seen, or the history was edited: longest common prefix instead
    placeholders = [{**m, "content": PLACEHOLDER.format(i)} for i, m in enumerate(seen)]
    before = render(loaded, placeholders, add_generation_prompt=False)
    after = render(loaded, placeholders + messages[len(seen) :], add_generation_prompt=True)
    if not after.startswith(before):
        return None
    new_text = after[len(before) :]
    if seen[-1]["role"] == "assistant":
        new_text = _reply_tail(loaded, before, placeholders[-1]["content"], session.transcript_ids) + new_text
    return session.transcript_ids + tokenize(loaded, new_text)


def _reply_tail(loaded: LoadedModel, before: str, last_placeholder: str, transcript_ids: list[int]) -> str:
    """What the template writes after a reply's content that the generated ids do not already hold.

    A reply that ended on the end-of-turn token holds it ('<|im_end|>'); the newline the
    template adds after it does not. A reply cut by max_tokens or a stop string holds neither.
    """
    tail = before[before.rindex(last_placeholder) + len(last_placeholder) :]
    last_token = loaded.tokenizer.decode([transcript_ids[-1]])
    if last_token and tail.startswith(last_token) and transcript_ids[-1] in loaded.eos_ids:
        return tail[len(last_token) :]
    return tail
