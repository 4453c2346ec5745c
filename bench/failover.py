"""Failover: sessions continuing on another replica after one dies, through nginx, with Redis as the shared tier.

Three kvserve replicas (the default model, one thread each), the shipped docker/scale nginx config in front
(consistent hash on X-Session-ID) and one redis-server, all on loopback. 24 sessions open with one shared
system prompt plus their own case (about 1,500 tokens), then 6 turns each, greedy, streamed, 6 in flight.

  1. reference run (tenant "ref"): nothing dies. Measures affinity (turns 2+ served from the home
     replica's device blocks), device-hit TTFT, and Redis' bytes against the bytes of the distinct tokens.
  2. failover run (tenant "run", the same conversations): one replica is SIGKILLed at a random moment.
     A turn whose stream broke is sent again (as a client would). Measures completed turns lost, turns
     not token-identical to the reference, and the TTFT of turns restored from Redis against recomputing
     the same prompt (no cache) and against the reference run's device hits.

Writes docs/benchmarks.md (section "failover") and docs/failover.png.

    python bench/failover.py [--sessions 24] [--turns 6] [--seed 1]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import StreamTimer, replace_section, spawn_server
from failover_report import IN_FLIGHT, MAX_TOKENS, plot, report
from multiturn import system_prompt

from tests.e2e.cluster import Nginx, Redis
from tests.e2e.server import SPAWNED

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"ref": "sk-bench-ref-0001", "run": "sk-bench-run-0001"}
QUESTIONS = ["What comes first?", "And after that?", "Any risk here?", "What would you skip?", "Sum it up.", "Why?"]
RETRY_FOR_S = 60  # a client sends a broken turn again for this long (a dead replica's lease lasts 15 s)


def case(i: int) -> str:
    """A session's own opening message (~330 tokens), distinct per session."""
    lines = [f"Case {i}, note {j}: traveller {i * 7 + j} plans day {j + 1} near camp {i + j * 3}." for j in range(25)]
    return "Here is my plan.\n" + "\n".join(lines)


class Conversation:
    def __init__(self, tenant: str, index: int) -> None:
        self.tenant, self.sid = tenant, f"conv-{index:02d}"
        self.messages = [{"role": "system", "content": system_prompt(16)}, {"role": "user", "content": case(index)}]
        self.rows: list[dict] = []


def one_turn(base: str, conv: Conversation, turn: int, started: float, cache: bool = True) -> dict:
    body = {"model": "smollm2-135m-instruct", "messages": conv.messages, "max_tokens": MAX_TOKENS, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {KEYS[conv.tenant]}"}
    if cache:
        headers["X-Session-ID"] = conv.sid
    else:
        body["cache_prompt"] = False
    timer = StreamTimer()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            timer.feed(line)
        meta = {k: r.headers.get(f"x-{k}", "") for k in ("kvserve-replica", "cache-source", "cache")}
    result = timer.result()
    if result["completion_tokens"] != MAX_TOKENS or timer.usage is None:
        raise RuntimeError("the stream ended early")
    return {"turn": turn, "at": time.perf_counter() - started, "replica": meta["kvserve-replica"]} | {
        "source": meta["cache-source"], "cache": meta["cache"], "text": result["text"], "ttft_s": result["ttft_s"],
        "prompt_tokens": result["prompt_tokens"], "cached_tokens": result["cached_tokens"],
    }  # fmt: skip


def run(base: str, tenant: str, sessions: int, turns: int, on_turn=lambda n: None) -> list[Conversation]:
    """Every conversation's turns in rounds (turn k of every conversation, IN_FLIGHT at once, then turn k + 1),
    so that a replica dying mid-run leaves every conversation it held part way."""
    convs = [Conversation(tenant, i) for i in range(sessions)]
    done, lock = [0], threading.Lock()
    started = time.perf_counter()

    def talk(conv: Conversation, turn: int) -> None:
        deadline, attempt = time.monotonic() + RETRY_FOR_S, 0
        while True:
            try:
                row = one_turn(base, conv, turn, started)
                break
            except (httpx.TransportError, RuntimeError) as exc:
                print(f"  {conv.sid} turn {turn}: {str(exc)[:120]}; sent again", flush=True)
                if time.monotonic() > deadline:
                    raise
            attempt += 1
            time.sleep(1.0)  # a 409: the dead replica's lease has not expired yet
        row["retries"] = attempt
        if attempt:
            print(f"  {conv.sid} turn {turn} done on {row['replica']}: {row['cached_tokens']} of "
                  f"{row['prompt_tokens']} tokens cached ({row['source']})", flush=True)  # fmt: skip
        conv.rows.append(row)
        conv.messages = [*conv.messages, {"role": "assistant", "content": row["text"]}]
        if turn < turns:
            conv.messages.append({"role": "user", "content": QUESTIONS[(turn - 1) % len(QUESTIONS)]})
        with lock:
            done[0] += 1
            on_turn(done[0])

    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        for turn in range(1, turns + 1):
            for future in [pool.submit(talk, conv, turn) for conv in convs]:
                future.result()
    return convs


def system_prompt_tokens(base: str) -> int:
    """The shared system prompt's length in tokens, as the server renders it (a session created with it)."""
    headers = {"Authorization": f"Bearer {KEYS['ref']}"}
    r = httpx.post(base + "/v1/sessions", json={"system": system_prompt(16)}, headers=headers, timeout=120)
    r.raise_for_status()
    return int(r.json()["system_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="the model's dtype (auto: bf16 here). In bf16 a prompt computed in other chunks (a cached system "
        "prompt, other batch neighbours) can already flip a greedy token, failover or not",
    )
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-failover-"))
    redis = Redis(tmp)
    env = {"KVSERVE_SHARED_URL": redis.url, "KVSERVE_API_KEYS": ",".join(f"{k}:{t}" for t, k in KEYS.items())}
    env |= {"KVSERVE_METRICS_NEEDS_KEY": "false", "OMP_NUM_THREADS": "1", "KVSERVE_DISK_KV_BUDGET_BYTES": "0"}
    if args.dtype != "auto":  # the shipped models.toml with another dtype
        models = (ROOT / "models" / "models.toml").read_text().replace('dtype = "auto"', f'dtype = "{args.dtype}"')
        (tmp / "models.toml").write_text(models)
        env["KVSERVE_MODELS_FILE"] = str(tmp / "models.toml")
    replicas = {}
    try:
        for name in ("r1", "r2", "r3"):
            extra = ["--state-dir", str(tmp / name)]
            proc, base = spawn_server(extra, env | {"KVSERVE_REPLICA_ID": name}, log=tmp / f"{name}.log")
            replicas[name] = (proc, base.removesuffix("/v1"))
            print(f"replica {name} ready at {replicas[name][1]}", flush=True)
        nginx = Nginx(tmp / "nginx", [int(b.rsplit(":", 1)[1]) for _, b in replicas.values()])

        print("reference run (nothing dies)", flush=True)
        reference = run(nginx.base, "ref", args.sessions, args.turns)
        redis_bytes = sum(redis.client.strlen(k) for k in redis.client.scan_iter("kvserve:blk:*"))
        num_blocks = len(list(redis.client.scan_iter("kvserve:blk:*")))
        system_tokens = system_prompt_tokens(nginx.base)

        victim = rng.choice(sorted(replicas))
        kill_after = rng.randint(args.sessions + 1, args.sessions * (args.turns - 1))  # in round 2 to the last but one
        killed_at = [0.0]
        t0 = time.perf_counter()

        def maybe_kill(num_done: int) -> None:
            if num_done == kill_after:
                replicas[victim][0].kill()
                killed_at[0] = time.perf_counter() - t0
                print(f"SIGKILL {victim} after {num_done} turns", flush=True)

        print("failover run", flush=True)
        failover = run(nginx.base, "run", args.sessions, args.turns, maybe_kill)
        restored = [(c, r) for c in failover for r in c.rows if r["source"] == "shared"]
        recompute = []
        for conv, row in restored:  # the same prompt, nothing cached: what recomputing it costs
            prompt = Conversation(conv.tenant, int(conv.sid.split("-")[1]))
            prompt.messages = conv.messages[: 2 + 2 * (row["turn"] - 1)]
            recompute.append(one_turn(nginx.base, prompt, row["turn"], t0, cache=False)["ttft_s"])
        turns_recorded = [
            httpx.get(
                nginx.base + f"/v1/sessions/{c.sid}",
                headers={"X-Session-ID": c.sid, "Authorization": f"Bearer {KEYS['run']}"},
            ).json()["turns"]
            for c in failover
        ]
    finally:
        for proc in SPAWNED:
            proc.kill()
        for proc, _ in replicas.values():
            proc.kill()
    summary = summarise(
        reference, failover, restored, recompute, turns_recorded, redis_bytes, num_blocks, system_tokens, args
    )
    summary |= {"victim": victim, "kill_after": kill_after}
    rows = {run: {c.sid: c.rows for c in convs} for run, convs in (("reference", reference), ("failover", failover))}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "failover.json").write_text(json.dumps(rows | {"summary": summary}, indent=1))
    for key, value in summary.items():
        print(f"{key}: {value}")
    if not args.no_docs:
        plot(ROOT / "docs" / "failover.png", reference, failover, restored, recompute, killed_at[0], victim)
        replace_section(ROOT / "docs" / "benchmarks.md", "failover", report(summary, args))


def summarise(reference, failover, restored, recompute, turns_recorded, redis_bytes, num_blocks, system_tokens, args):
    later = [r for c in reference for r in c.rows[1:]]
    home = {c.sid: c.rows[0]["replica"] for c in reference}
    affine = [r for c in reference for r in c.rows[1:] if r["replica"] == home[c.sid] and r["source"] == "device"]
    device = [r["ttft_s"] for r in later if r["source"] == "device"]
    pairs = [(a, b) for x, y in zip(reference, failover, strict=True) for a, b in zip(x.rows, y.rows, strict=True)]
    same = sum(a["text"] == b["text"] for a, b in pairs)
    for a, b in pairs:
        if a["text"] != b["text"]:
            print(f"  differs: turn {b['turn']} (reference {a['source']} on {a['replica']}, this run {b['source']} "
                  f"on {b['replica']}): {a['text']!r} / {b['text']!r}")  # fmt: skip
    # Distinct tokens: the shared system prompt once, then each transcript's own tokens.
    distinct = system_tokens + sum(c.rows[-1]["prompt_tokens"] + MAX_TOKENS - system_tokens for c in reference)
    bytes_per_token = (redis_bytes / num_blocks - 32) / 16 if num_blocks else float("nan")
    shared_ttft = [r["ttft_s"] for _, r in restored]
    return {
        "turns": len(later) + len(reference),
        "lost": sum(args.turns - n for n in turns_recorded),
        "identical": same,
        "compared": sum(len(c.rows) for c in failover),
        "retried": sum(r["retries"] for c in failover for r in c.rows),
        "affinity": len(affine) / len(later),
        "device_ttft_ms": 1000 * statistics.median(device),
        "shared_ttft_ms": 1000 * statistics.median(shared_ttft) if shared_ttft else float("nan"),
        "recompute_ttft_ms": 1000 * statistics.median(recompute) if recompute else float("nan"),
        "num_restored": len(restored),
        "shared_cached": statistics.median(r["cached_tokens"] for _, r in restored) if restored else 0,
        "shared_prompt": statistics.median(r["prompt_tokens"] for _, r in restored) if restored else 0,
        "redis_bytes": redis_bytes,
        "distinct_bytes": distinct * bytes_per_token,
        "history_tokens": statistics.median(c.rows[0]["prompt_tokens"] for c in reference),
    }


if __name__ == "__main__":
    main()
