"""One running request inside the engine: its cache, sampler, detokenizer and stop rules."""

from __future__ import annotations

import time

from server.engine.detokenizer import Detokenizer
from server.engine.generate import Forward
from server.engine.handle import RequestHandle
from server.engine.kv_cache import bytes_per_token, cache_from_snapshot, cache_nbytes, crop_cache, new_cache
from server.engine.kv_store import Entry, KVStore
from server.engine.registry import LoadedModel
from server.engine.sampler import Sampler
from server.engine.session import CompletedTurn
from server.engine.types import Admitted, GenerationRequest, TextDelta, TokenLogprob, Usage


class Sequence:
    def __init__(self, request: GenerationRequest, entry: Entry | None, handle: RequestHandle, loaded: LoadedModel):
        self.request = request
        self.entry = entry
        self.handle = handle
        self.loaded = loaded
        self.started = time.monotonic()
        self.cache = None
        self.fed_ids: list[int] = []  # tokens whose K/V the cache holds, in order
        self.num_cached = 0  # prompt tokens reused from the session, not fed to the model
        self.generated_ids: list[int] = []
        self.text_parts: list[str] = []  # the text sent so far, for the session's record of the reply
        self.finish_reason: str | None = None
        self.is_prefilled = False
        self.has_taken_cache = False  # the session's cache moved into this sequence (per-session engine)
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[TokenLogprob] = []
        params = request.params
        self.sampler = Sampler(params, request.prompt_ids, loaded.vocab_size, loaded.device)
        self.detok = Detokenizer(loaded.tokenizer, params.stop)
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= loaded.eos_ids

    def is_past_deadline(self) -> bool:
        timeout = self.request.timeout_s
        return timeout is not None and time.monotonic() - self.started > timeout

    def prefill(self, store: KVStore, forward: Forward) -> TextDelta | None:
        prompt = self.request.prompt_ids
        is_reusing = self.entry is not None and self.request.use_cache
        cache, num_cached = store.take_cache(self.entry, prompt) if is_reusing else (None, 0)
        self.has_taken_cache = is_reusing
        if cache is not None and not crop_cache(cache, num_cached):
            cache, num_cached = None, 0  # a cache that cannot be cut back is recomputed
        source = "device" if cache is not None and num_cached else "none"
        if cache is None and is_reusing and self.request.snapshot is not None:
            cache, num_cached = cache_from_snapshot(
                self.loaded.model.config, self.request.snapshot, prompt, self.loaded.device
            )
            source = self.request.snapshot.origin if cache is not None else "none"
        if cache is None:
            cache, num_cached = new_cache(self.loaded.model.config), 0
        self.cache, self.num_cached = cache, num_cached
        self.handle.push(Admitted(len(prompt), num_cached, source))
        self.fed_ids = prompt[:num_cached]
        num_new = len(prompt) - num_cached + self.request.params.max_tokens
        growth = num_new * bytes_per_token(self.loaded.model.config, self.loaded.dtype)
        store.make_room(cache_nbytes(cache) + growth)
        logits = forward(prompt[num_cached:], cache, num_cached, is_prefill=True)
        self.fed_ids = list(prompt)
        self.is_prefilled = True
        if self.request.is_prefill_only:
            self.finish_reason = "length"
            return None
        return self.accept(*self.sampler.sample(logits))

    def decode(self, forward: Forward) -> TextDelta | None:
        last = self.generated_ids[-1]
        logits = forward([last], self.cache, len(self.fed_ids), is_prefill=False)
        self.fed_ids.append(last)
        return self.accept(*self.sampler.sample(logits))

    def accept(self, token_id: int, logprob: TokenLogprob | None) -> TextDelta | None:
        self.generated_ids.append(token_id)
        self.sampler.observe(token_id)
        if token_id in self._stop_ids:
            text, self.finish_reason = self.detok.flush(), "stop"
        else:
            text, is_stopped = self.detok.add(token_id)
            if is_stopped:
                self.finish_reason = "stop"
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
        total = len(self.request.prompt_ids) + len(self.generated_ids)
        return len(self.generated_ids) >= self.request.params.max_tokens or total >= self.loaded.max_context

    def transcript_ids(self) -> list[int]:
        return self.request.prompt_ids + self.generated_ids

    def usage(self) -> Usage:
        return Usage(len(self.request.prompt_ids), len(self.generated_ids), self.num_cached)

    def completed_turn(self, reason: str) -> CompletedTurn:
        request = self.request
        return CompletedTurn(
            self.transcript_ids(),
            "".join(self.text_parts),
            reason,
            self.usage(),
            request.messages,
            request.is_prefill_only,
        )
