"""Shared test helpers: run one request through an engine, the HF reference, and bounded waits."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from server.engine.config import EngineConfig
from server.engine.engine import Engine, EngineStats
from server.engine.request import Admitted, Failed, Finished, GenerationRequest, SamplingParams, TextDelta
from server.kv.block_store import BlockStore
from server.kv.tiers import TierFormats, TierStore
from server.models.loader import LoadedModel
from server.sessions.record import SessionKey, Usage
from server.sessions.store import SessionStore

T = TypeVar("T")
# How long any wait of a test may last before it fails with its message. Never a claim about speed: what is
# awaited takes milliseconds to seconds here, and CI may run ten times slower on a busy machine.
DEADLINE_S = 120.0


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: Failed | None = None
    logprobs: list = field(default_factory=list)
    admitted: Admitted | None = None


def request(prompt_ids, session: str | None = None, rid: str = "r", kv_source: str | None = None, **params):
    """A GenerationRequest as the serving layer builds it: greedy unless told otherwise."""
    timeout_s = params.pop("timeout_s", None)
    max_unread_events = params.pop("max_unread_events", None)
    use_cache = params.pop("use_cache", True)
    constraint = params.pop("constraint", None)
    banned_openings = params.pop("banned_openings", ())
    params.setdefault("temperature", 0.0)
    key = SessionKey("default", session) if session else None
    return GenerationRequest(
        request_id=rid,
        prompt_ids=list(prompt_ids),
        params=SamplingParams(**params),
        session=key,
        kv_source=SessionKey("default", kv_source) if kv_source else key,
        use_cache=use_cache,
        timeout_s=timeout_s,
        max_unread_events=max_unread_events,
        constraint=constraint,
        banned_openings=banned_openings,
    )


async def collect(handle) -> Result:
    out = Result()
    async for event in handle:
        if isinstance(event, Admitted):
            out.admitted = event
        elif isinstance(event, TextDelta):
            out.token_ids += event.token_ids
            out.text += event.text
            out.logprobs += event.logprobs or []
        elif isinstance(event, Finished):
            out.finish_reason, out.usage = event.finish_reason, event.usage
        else:
            out.error = event
    return out


async def run(engine: Engine, prompt_ids, session: str | None = None, rid: str = "r", **params) -> Result:
    return await collect(engine.submit(request(prompt_ids, session, rid, **params)))


@contextlib.asynccontextmanager
async def paused(engine: Engine) -> AsyncIterator[None]:
    """Hold the engine thread between two steps: what is submitted meanwhile is taken in one go afterwards."""
    entered, gate = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(DEADLINE_S)

    answered = asyncio.ensure_future(engine.query(hold))
    assert await asyncio.to_thread(entered.wait, DEADLINE_S), "the engine thread never paused"
    try:
        yield
    finally:
        gate.set()
        await answered


async def settled(engine: Engine) -> EngineStats:
    """The engine's stats once it has finished the step it was in (a question is answered between steps)."""
    await engine.query(lambda: None)
    return engine.stats


def make_engine(
    loaded: LoadedModel,
    store: SessionStore | None = None,
    tiers: TierStore | None = None,
    **config,
) -> Engine:
    """A started engine over its own store and tiers (memory only unless given)."""
    config.setdefault("budget_bytes", 4 << 20)
    engine_config = EngineConfig(**config)
    tiers = tiers or TierStore(0, 0, None, engine_config.block_size)
    store = store or SessionStore(ttl_s=3600, forgetters=(tiers,))
    engine = Engine(loaded, store, tiers, engine_config)
    engine.start()
    return engine


@contextlib.contextmanager
def tiers_below(tier: str, directory: Path, block_size: int, formats: TierFormats | None = None) -> Iterator[TierStore]:
    """Tiers where a session's K/V evicted from the pool lands in `tier`: host RAM (a disk below it), the disk
    (no host RAM), or Redis ("shared": a real redis-server on loopback, no host RAM and no disk)."""
    from server.kv.redis_blocks import RedisBlocks
    from tests.e2e.redis_server import Redis

    redis = Redis(directory) if tier == "shared" else None
    disk = None if redis is not None else directory / "kv"
    tiers = TierStore((1 << 30) if tier == "host" else 0, 1 << 30, disk, block_size, formats or TierFormats())
    if redis is not None:
        tiers.shared = BlockStore(RedisBlocks(redis.url), "shared")
    try:
        yield tiers
    finally:
        tiers.close()
        if tiers.shared is not None:
            tiers.shared.close()
        if redis is not None:
            redis.stop()


def wait_until(condition: Callable[[], object], timeout_s: float = DEADLINE_S, what: str = "the condition") -> None:
    """Poll until `condition()` is true; fail with a message after `timeout_s` (never hang a test)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.005)


async def wait_until_async(
    condition: Callable[[], object], timeout_s: float = DEADLINE_S, what: str = "the condition"
) -> None:
    """The asyncio form of wait_until: yields to the loop between polls."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        await asyncio.sleep(0.005)


def reference_greedy(model, prompt_ids: list[int], num_new: int) -> list[int]:
    """HF generate, greedy, fixed length; asserts no near-tie could flip an argmax on rounding."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    for scores in out.scores:  # raw scores per step, [1, V]
        top2 = torch.topk(scores[0].double(), 2).values
        assert float(top2[0] - top2[1]) > 1e-6, "seed gives a near-tie: pick another"
    return out.sequences[0, len(prompt_ids) :].tolist()


def ask(engine: Engine, fn: Callable[[], T]) -> T:
    """From a test thread without an event loop: `fn()` answered on the engine thread, between steps."""
    return asyncio.run(engine.query(fn))


def pool_tokens(engine: Engine, token_ids: list[int], tenant: str = "default") -> int:
    """How many of these tokens' K/V the engine's pool holds (by prefix, for the tenant)."""
    return ask(engine, lambda: engine.blocks.chain(tenant, token_ids)[1])
