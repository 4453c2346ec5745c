"""One request inside the engine: its status, its blocks, its tokens, sampler, detokenizer and stop rules."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future

from server.engine.detokenizer import Detokenizer
from server.engine.handle import RequestHandle
from server.engine.openings import OpeningBan, OpeningBans
from server.engine.request import GenerationRequest, TextDelta, TokenLogprob
from server.engine.sampler import Sampler
from server.kv.blocks import Block
from server.kv.snapshot import Snapshot
from server.models.loader import LoadedModel
from server.sessions.record import CompletedTurn, Session, Usage


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued until its blocks can be reserved
    LOADING = "loading"  # a lower tier's snapshot of its prompt is being read, off the engine thread
    RUNNING = "running"  # holds blocks: prefilling in chunks, then decoding one token per step
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request: GenerationRequest,
        session: Session | None,
        handle: RequestHandle,
        loaded: LoadedModel,
        openings: OpeningBans | None = None,
    ) -> None:
        self.request = request
        self.session = session  # locked for this request; None for stateless requests and busy buckets
        self.handle = handle
        self.status = SequenceStatus.WAITING
        self.started = time.monotonic()
        self.token_ids = list(request.prompt_ids)  # prompt, then every generated token
        self.num_prompt = len(request.prompt_ids)
        self.num_computed = 0  # tokens whose K/V is in this sequence's blocks (token_ids[:num_computed])
        self.num_cached = 0  # prompt tokens reused (pool or snapshot), not fed to the model
        self.blocks: list[Block] = []
        self.num_reserved = 0  # blocks promised at admission, not allocated yet
        self.copy_source: Block | None = None  # a cached block pinned at admission until its matching slots are copied
        self.use_cache = request.use_cache  # False: reuse nothing and publish nothing
        self.snapshot: Snapshot | None = None  # read from a lower tier while LOADING
        self.loading: Future[Snapshot | None] | None = None
        self.has_looked_down = False  # the tiers were consulted once; a snapshot is never read twice
        self.text_parts: list[str] = []  # the text sent so far, for the session's record of the reply
        self.finish_reason: str | None = None
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[TokenLogprob] = []
        params = request.params
        self.sampler = Sampler(params, request.prompt_ids, loaded.vocab_size, loaded.device)
        self.detok = Detokenizer(loaded.tokenizer, params.stop, request.shown_special_ids)
        self.constraint = request.constraint
        # A grammar decides alone: it may need what a ban masks (a forced call opens with a tag of its own).
        self.opening_ban: OpeningBan | None = None
        if request.banned_openings and openings is not None and self.constraint is None:
            self.opening_ban = openings.ban(request.banned_openings)
        self._is_reply_over = request.reply_watch() if request.reply_watch is not None else None
        # A grammar that is done allows only the end of sequence: it ends the reply even with ignore_eos.
        ends = set() if params.ignore_eos and self.constraint is None else set(loaded.eos_ids)
        self._stop_ids = set(params.stop_token_ids) | ends
        self._max_context = loaded.max_context

    @property
    def salt(self) -> str:
        return self.request.tenant

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed >= self.num_prompt

    @property
    def max_len(self) -> int:
        """The prompt and every token it may generate: what admission reserves blocks for."""
        return self.num_prompt + self.request.params.max_tokens

    def next_input(self, budget: int) -> list[int]:
        """The tokens to feed next: the last sampled one, or up to `budget` prompt tokens."""
        if self.is_prefilled:
            return self.token_ids[-1:]
        return self.token_ids[self.num_computed : min(self.num_computed + budget, self.num_prompt)]

    def is_past_deadline(self) -> bool:
        timeout = self.request.timeout_s
        return timeout is not None and time.monotonic() - self.started > timeout

    @property
    def is_ended(self) -> bool:
        """Nothing more it computes is wanted: its client left, stopped reading, or its time ran out."""
        return self.handle.is_cancelled or self.handle.is_overflowing or self.is_past_deadline()

    def accept(self, token_id: int, logprob: TokenLogprob | None) -> TextDelta | None:
        """A sampled token: stop rules, then the text that became final (None while nothing did)."""
        self.token_ids.append(token_id)
        self.sampler.observe(token_id)
        if self.opening_ban is not None:
            self.opening_ban.observe(token_id)
        if self.constraint is not None and token_id not in self._stop_ids and not self.constraint.consume(token_id):
            raise RuntimeError(f"the output grammar refused token {token_id}: {self.constraint.error}")
        if token_id in self._stop_ids:
            text, self.finish_reason = self.detok.flush(), "stop"
        else:
            text, is_stopped = self.detok.add(token_id)
            if is_stopped:
                self.finish_reason = "stop"
            elif text and self._is_reply_over is not None and self._is_reply_over(text):
                text, self.finish_reason = text + self.detok.flush(), "stop"
            elif self._is_at_length_limit():
                text, self.finish_reason = text + self.detok.flush(), "length"
        self._pending_ids.append(token_id)
        if logprob is not None:
            self._pending_logprobs.append(logprob)
        if not text and logprob is None and self.finish_reason is None:
            return None  # no visible text yet (e.g. half a character): report these ids with the next text
        self.text_parts.append(text)
        delta = TextDelta(text, self._pending_ids, self._pending_logprobs or None)
        self._pending_ids, self._pending_logprobs = [], []
        return delta

    def _is_at_length_limit(self) -> bool:
        num_generated = len(self.token_ids) - self.num_prompt
        return num_generated >= self.request.params.max_tokens or len(self.token_ids) >= self._max_context

    def usage(self) -> Usage:
        # With use_cache (cache_prompt and prefix caching on) every prompt token computed here is published
        written = self.num_prompt - self.num_cached if self.use_cache else 0
        return Usage(self.num_prompt, len(self.token_ids) - self.num_prompt, self.num_cached, written)

    def completed_turn(self, finish_reason: str) -> CompletedTurn:
        text, reply = "".join(self.text_parts), self.request.reply
        return CompletedTurn(
            transcript_ids=list(self.token_ids),
            text=text,
            finish_reason=finish_reason,
            usage=self.usage(),
            messages=self.request.messages,
            is_prefill_only=self.request.is_prefill_only,
            reply=reply(text) if reply is not None and not self.request.is_prefill_only else None,
            tools=self.request.tools,
        )
