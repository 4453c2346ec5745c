"""What a tier keeping K/V in fewer bits than the pool costs: cached-vs-recomputed agreement per tier K/V dtype.

python bench/tier_quality.py --corpus FILE [--model ID_OR_SOURCE] [--dtype float32] [--turns 96] [--kv int8,fp8]
    [--deterministic] [--no-docs]

Each of --turns passages of the corpus (--prompt tokens, from evenly spread offsets) is a two-turn session
on the engine (the real pool, tiers and restore path), with the pool in the compute dtype and the disk tier
set to each K/V dtype in turn (`pool`, the control, then int8 and fp8):

1. turn one: the passage's first --cut tokens, one token generated;
2. the session's K/V is copied to the disk tier (in that tier's K/V dtype) and dropped from the pool;
3. turn two: the whole transcript and the rest of the passage, continued greedily for --new tokens; its K/V
   up to there is restored from disk (checked: X-Cache-Source would say `disk`), the rest computed.

Each turn two is compared with the same prompt computed afresh (no cache): the share of turns whose tokens
are equal, and the share of all tokens generated before a turn's first difference. 8 sessions run at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta
from server.kv.pool import KVLayout
from server.kv.tiers import TierFormats, TierStore
from server.models.loader import LoadedModel, load_model
from server.sessions.record import SessionKey
from server.sessions.store import SessionStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine_line, replace_section
from kv_quality import spec_of

AT_ONCE = 8


async def turn(engine: Engine, rid: str, prompt: list[int], num_new: int, session: SessionKey | None) -> tuple:
    """(token ids, where the cached prefix came from, how many tokens it held)."""
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(
        request_id=rid, prompt_ids=prompt, params=params, session=session, kv_source=session, use_cache=bool(session)
    )
    handle = engine.submit(request)
    ids: list[int] = []
    admitted = await anext(handle)
    if not hasattr(admitted, "source"):
        raise RuntimeError(f"{rid} refused: {admitted}")
    async for event in handle:
        if isinstance(event, TextDelta):
            ids += event.token_ids
        elif isinstance(event, Finished):
            return ids, admitted.source, admitted.num_cached
        elif hasattr(event, "code"):
            raise RuntimeError(f"{rid} failed: {event}")
    raise RuntimeError(f"{rid} ended without finishing")


def evict(engine: Engine, held: list[tuple[SessionKey, list[int]]]) -> None:
    """On the engine thread: each session's K/V down to disk, and out of the pool."""
    for key, transcript in held:
        if not engine.offloader.save(key, transcript):
            raise RuntimeError(f"session {key.name} was not saved")
        engine.offloader.forget(key, transcript)


async def sessions(engine: Engine, tiers: TierStore, passages: list[list[int]], cut: int, num_new: int) -> list:
    """Turn two of each passage's session, its K/V up to there restored from the disk tier."""
    out: list[list[int]] = []
    for start in range(0, len(passages), AT_ONCE):
        batch = list(range(start, min(start + AT_ONCE, len(passages))))
        keys = {i: SessionKey("default", f"s{i}") for i in batch}
        firsts = await asyncio.gather(*(turn(engine, f"a{i}", passages[i][:cut], 1, keys[i]) for i in batch))
        transcripts = {i: passages[i][:cut] + first[0] for i, first in zip(batch, firsts, strict=True)}

        await engine.query(lambda held=[(keys[i], transcripts[i]) for i in batch]: evict(engine, held))
        tiers.flush_pending()
        prompts = {i: transcripts[i] + passages[i][cut:] for i in batch}
        seconds = await asyncio.gather(*(turn(engine, f"b{i}", prompts[i], num_new, keys[i]) for i in batch))
        for i, (ids, source, num_cached) in zip(batch, seconds, strict=True):
            if source != "disk" or num_cached < cut:
                raise RuntimeError(f"turn two of session {i} was not restored from disk: {source}, {num_cached}")
            out.append(ids)
            engine.store.delete(keys[i])
    return out


async def afresh(engine: Engine, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(prompts), AT_ONCE):
        batch = range(start, min(start + AT_ONCE, len(prompts)))
        out += [r[0] for r in await asyncio.gather(*(turn(engine, f"c{i}", prompts[i], num_new, None) for i in batch))]
    return out


def engine_for(loaded: LoadedModel, tiers: TierStore, longest: int, deterministic: bool) -> Engine:
    token_bytes = KVLayout.of(loaded.model.config, loaded.dtype).bytes_per_token
    budget = 2 * AT_ONCE * (longest + 64) * token_bytes
    store = SessionStore(ttl_s=3600, forgetters=(tiers,))
    config = EngineConfig(budget_bytes=budget, block_size=16, kv_dtype="compute", deterministic=deterministic)
    engine = Engine(loaded, store, tiers, config)
    engine.start()
    return engine


def agreement(turns: list[list[int]], base: list[list[int]]) -> dict[str, float]:
    same = sum(a == b for a, b in zip(turns, base, strict=True))
    before = sum(
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
        for a, b in zip(turns, base, strict=True)
    )
    return {"turns_equal": same / len(base), "tokens_before_first_difference": before / sum(map(len, base))}


def measure(args, text: str) -> dict:
    spec = dataclasses.replace(spec_of(args.model), dtype=args.dtype)
    loaded = load_model(spec, ROOT / "models" / "cache")
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    span = len(ids) - args.prompt - 1
    passages = [ids[i * span // args.turns : i * span // args.turns + args.prompt] for i in range(args.turns)]
    result: dict = {"model": loaded.spec.id, "dtype": str(loaded.dtype).removeprefix("torch."), "tiers": {}}
    turns: dict[str, list[list[int]]] = {}
    for name in ("pool", *filter(None, args.kv.split(","))):
        with tempfile.TemporaryDirectory() as directory:
            tiers = TierStore(0, 1 << 40, Path(directory), 16, TierFormats(disk=name))
            engine = engine_for(loaded, tiers, args.prompt + 1, args.deterministic)
            try:
                turns[name] = asyncio.run(sessions(engine, tiers, passages, args.cut, args.new))
            finally:
                engine.stop()
                tiers.close()
    # Turn one is computed in the compute dtype, one token greedy, in every run: turn two's prompts are the same in
    # all of them. They are computed afresh, with no cache, on an engine of their own.
    engine = engine_for(loaded, TierStore(0, 0, None, 16), args.prompt + 1, args.deterministic)
    try:

        async def afresh_turns() -> list[list[int]]:
            firsts = await afresh(engine, [p[: args.cut] for p in passages], 1)
            full = [p[: args.cut] + f + p[args.cut :] for p, f in zip(passages, firsts, strict=True)]
            return await afresh(engine, full, args.new)

        base = asyncio.run(afresh_turns())
    finally:
        engine.stop()
    for name, got in turns.items():
        result["tiers"][name] = agreement(got, base)
        print(name, json.dumps(result["tiers"][name]), flush=True)
    return result


def report(result: dict, args, corpus: str) -> str:
    lines = [
        "## K/V kept in fewer bits below the pool: what a restore costs",
        "",
        f"`python bench/tier_quality.py --corpus {corpus} --dtype {args.dtype} --turns {args.turns}"
        + (" --deterministic" if args.deterministic else "")
        + "` "
        f"({machine_line()}). {args.turns} two-turn sessions on {result['model']} ({result['dtype']} pool): turn "
        f"one is a passage's first {args.cut} tokens, then its K/V goes to the disk tier in that tier's K/V dtype "
        f"and leaves the pool; turn two (the transcript and the passage's other {args.prompt - args.cut} tokens, "
        f"{args.new} tokens greedy) restores it from disk. Compared with the same prompt computed afresh, no cache.",
        "",
        "| disk tier K/V dtype | turns equal | tokens before the first difference |",
        "|---|---:|---:|",
    ]
    for name, m in result["tiers"].items():
        label = f"{name} (as the pool: the control)" if name == "pool" else name
        lines.append(f"| {label} | {m['turns_equal']:.1%} | {m['tokens_before_first_difference']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="a UTF-8 text file (e.g. one shipped in a package)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", help="the pool's (compute) dtype")
    parser.add_argument("--turns", type=int, default=96)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--cut", type=int, default=192, help="turn one's tokens: what the tier holds")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--kv", default="int8,fp8", help="the disk tier's K/V dtypes besides the pool's (may be empty)")
    parser.add_argument("--deterministic", action="store_true", help="the engines in deterministic mode")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    text = Path(args.corpus).read_text(encoding="utf-8", errors="replace")
    result = measure(args, text)
    out = ROOT / "bench" / "results" / "tier_quality.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    body = report(result, args, Path(args.corpus).name)
    print(body)
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "tier-quality", body)


if __name__ == "__main__":
    main()
