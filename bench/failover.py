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

Every time the client sends a turn again is counted, with its reason. Only what the kill explains is
expected: a turn in flight at the kill, broken once (its stream cut, its connection dropped) and answered
409 session_busy while the dead replica's lease lasts. Anything else fails the run (exit status 1 and a
list of what failed, docs left alone): a 502 (nginx must pass a request the dead replica never answered on
to the next one), any other error status, a resend in the reference run or of a turn that was not in flight,
a turn still failing after RETRY_FOR_S.
nginx's own resends (requests it passed on to the next replica) are counted from its error log.

Writes docs/benchmarks.md (section "failover") and docs/failover.png. Every process it starts (replicas,
redis-server, nginx's master and workers) is ended, even on Ctrl-C, SIGTERM or an error.

    python bench/failover.py [--sessions 24] [--turns 6] [--seed 1]
    python bench/failover.py --sessions 6 --turns 3 --no-docs    # a quick run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import random
import signal
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
from tests.e2e.server import SPAWNED, end_all

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"ref": "sk-bench-ref-0001", "run": "sk-bench-run-0001"}
QUESTIONS = ["What comes first?", "And after that?", "Any risk here?", "What would you skip?", "Sum it up.", "Why?"]
RETRY_FOR_S = 60  # a client sends a broken turn again for this long (a dead replica's lease lasts 15 s)
PAUSE_S = 1.0  # between two sends of one turn


def case(i: int) -> str:
    """A session's own opening message (~330 tokens), distinct per session."""
    lines = [f"Case {i}, note {j}: traveller {i * 7 + j} plans day {j + 1} near camp {i + j * 3}." for j in range(25)]
    return "Here is my plan.\n" + "\n".join(lines)


class TurnFailed(Exception):
    """A turn that did not complete: `status` is the HTTP status when one came (200 for a stream cut short), None
    when the connection itself failed; `code` the error code of kvserve's answer, if it gave one."""

    def __init__(self, status: int | None, message: str, code: str | None = None) -> None:
        super().__init__(f"{status or 'no answer'}: {message}")
        self.status, self.message, self.code = status, message, code

    @classmethod
    def of_answer(cls, status: int, body: bytes) -> TurnFailed:
        try:
            code = json.loads(body)["error"]["code"]
        except (ValueError, KeyError, TypeError):  # not kvserve's error envelope: nginx's 502 page, say
            code = None
        return cls(status, " ".join(body[:300].decode(errors="replace").split()), code)  # on one line


@dataclasses.dataclass(slots=True)
class Resend:
    tenant: str
    sid: str
    turn: int
    status: int | None  # the failed attempt's
    code: str | None
    reason: str


@dataclasses.dataclass(slots=True)
class Client:
    """What the client saw across both runs: every resend, and the turns in flight when the replica died."""

    stop: threading.Event = dataclasses.field(default_factory=threading.Event)  # Ctrl-C or an error: give up at once
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    resends: list[Resend] = dataclasses.field(default_factory=list)
    in_flight: set[tuple[str, str, int]] = dataclasses.field(default_factory=set)
    in_flight_at_kill: set[tuple[str, str, int]] = dataclasses.field(default_factory=set)

    def unexpected(self) -> list[str]:
        """Resends the kill does not explain, as sentences."""
        problems, broken = [], set()
        for r in self.resends:
            where = f"{r.tenant} {r.sid} turn {r.turn}"
            if r.status == 502:
                problems.append(f"{where}: 502 from nginx ({r.reason})")
            elif r.tenant != "run" or (r.tenant, r.sid, r.turn) not in self.in_flight_at_kill:
                problems.append(f"{where}: sent again though no replica died under it ({r.reason})")
            elif r.status not in (None, 200, 409) or (r.status == 409 and r.code != "session_busy"):
                problems.append(f"{where}: an error no dead replica explains ({r.reason})")
            elif r.status != 409:
                if (r.sid, r.turn) in broken:
                    problems.append(f"{where}: broken a second time ({r.reason})")
                broken.add((r.sid, r.turn))
        return problems


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
    timer, status = StreamTimer(), None
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
            status = r.status_code
            if r.status_code != 200:
                raise TurnFailed.of_answer(r.status_code, r.read())
            for line in r.iter_lines():
                timer.feed(line)
            meta = {k: r.headers.get(f"x-{k}", "") for k in ("kvserve-replica", "cache-source", "cache")}
    except httpx.TransportError as exc:
        raise TurnFailed(status, f"{type(exc).__name__}: {exc}") from exc
    except RuntimeError as exc:  # an error event in the stream
        raise TurnFailed(status, f"error event: {exc}") from exc
    result = timer.result()
    if result["completion_tokens"] != MAX_TOKENS or timer.usage is None:
        raise TurnFailed(status, "the stream ended early")
    return {"turn": turn, "at": time.perf_counter() - started, "replica": meta["kvserve-replica"]} | {
        "source": meta["cache-source"], "cache": meta["cache"], "text": result["text"], "ttft_s": result["ttft_s"],
        "prompt_tokens": result["prompt_tokens"], "cached_tokens": result["cached_tokens"],
    }  # fmt: skip


def run(
    base: str, client: Client, tenant: str, sessions: int, turns: int, on_turn=lambda n: None
) -> list[Conversation]:
    """Every conversation's turns in rounds (turn k of every conversation, IN_FLIGHT at once, then turn k + 1),
    so that a replica dying mid-run leaves every conversation it held part way."""
    convs = [Conversation(tenant, i) for i in range(sessions)]
    done, lock = [0], client.lock
    started = time.perf_counter()

    def talk(conv: Conversation, turn: int) -> None:
        deadline, attempt, key = time.monotonic() + RETRY_FOR_S, 0, (tenant, conv.sid, turn)
        with lock:
            client.in_flight.add(key)
        while True:
            if client.stop.is_set():
                raise RuntimeError("stopped")
            try:
                row = one_turn(base, conv, turn, started)
                break
            except TurnFailed as exc:
                with lock:
                    client.resends.append(Resend(tenant, conv.sid, turn, exc.status, exc.code, exc.message[:200]))
                print(f"  {conv.sid} turn {turn}: {str(exc)[:120]}; sent again", flush=True)
                if time.monotonic() > deadline:
                    raise
            attempt += 1
            client.stop.wait(PAUSE_S)  # a 409: the dead replica's lease has not expired yet
        with lock:
            client.in_flight.discard(key)
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

    pool = concurrent.futures.ThreadPoolExecutor(IN_FLIGHT)
    try:
        for turn in range(1, turns + 1):
            for future in [pool.submit(talk, conv, turn) for conv in convs]:
                future.result()
    except BaseException:  # Ctrl-C or a turn that never completed: the others give up too
        client.stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
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
    if args.sessions < 1 or args.turns < 3:
        parser.error(
            "--sessions must be 1 or more and --turns 3 or more (the kill falls in round 2 to the last but one)"
        )
    # SIGTERM as Ctrl-C: the cleanup below runs (the processes started here are out of the terminal's group).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-failover-"))
    client = Client()
    try:
        outcome = measure(args, rng, tmp, client)
    except TurnFailed as exc:  # a turn still failing after RETRY_FOR_S, or a request that is not resent failed
        outcome = exc
    finally:
        client.stop.set()
        end_all()  # every process group started here: replicas, redis-server, nginx's master and workers
    problems = client.unexpected()
    if isinstance(outcome, TurnFailed):
        print("FAILED:", *problems, f"a request failed: {str(outcome)[:300]}", sep="\n  ", file=sys.stderr)
        sys.exit(1)
    reference, failover, restored, recompute, turns_recorded, redis_stats, system_tokens, killed, nginx_log = outcome
    summary = summarise(reference, failover, restored, recompute, turns_recorded, *redis_stats, system_tokens, args)
    summary |= {"victim": killed["victim"], "kill_after": killed["after"]}
    summary |= resend_summary(client, nginx_log)
    rows = {run: {c.sid: c.rows for c in convs} for run, convs in (("reference", reference), ("failover", failover))}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    resends = [dataclasses.asdict(r) for r in client.resends]
    (ROOT / "bench" / "results" / "failover.json").write_text(
        json.dumps(rows | {"summary": summary, "resends": resends}, indent=1)
    )
    for key, value in summary.items():
        print(f"{key}: {value}")
    if problems:
        print(f"FAILED: {len(problems)} resends the kill does not explain:", *problems, sep="\n  ", file=sys.stderr)
        sys.exit(1)
    if not args.no_docs:
        plot(ROOT / "docs" / "failover.png", reference, failover, restored, recompute, killed["at"], killed["victim"])
        replace_section(ROOT / "docs" / "benchmarks.md", "failover", report(summary, args))


def resend_summary(client: Client, nginx_log: str) -> dict:
    """The client's resends by reason, and nginx's own: requests it passed on from a replica that failed them."""
    ours = [r for r in client.resends if r.tenant == "run"]
    return {
        "resends": len(client.resends),
        "resends_busy": sum(r.status == 409 for r in ours),
        "resends_broken": sum(r.status != 409 for r in ours),
        "turns_resent": len({(r.sid, r.turn) for r in ours}),
        "in_flight_at_kill": len(client.in_flight_at_kill),
        "status_502": sum(r.status == 502 for r in client.resends),
        "nginx_passed_on": sum(
            "while reading response header from upstream" in line or "while connecting to upstream" in line
            for line in nginx_log.splitlines()
            if "[error]" in line
        ),
    }


def measure(args, rng: random.Random, tmp: Path, client: Client):
    """Both runs and the measures that need the processes; the caller ends the processes."""
    redis = Redis(tmp)
    env = {"KVSERVE_SHARED_URL": redis.url, "KVSERVE_API_KEYS": ",".join(f"{k}:{t}" for t, k in KEYS.items())}
    env |= {"KVSERVE_METRICS_NEEDS_KEY": "false", "OMP_NUM_THREADS": "1", "KVSERVE_DISK_KV_BUDGET_BYTES": "0"}
    if args.dtype != "auto":  # the shipped models.toml with another dtype
        models = (ROOT / "models" / "models.toml").read_text().replace('dtype = "auto"', f'dtype = "{args.dtype}"')
        (tmp / "models.toml").write_text(models)
        env["KVSERVE_MODELS_FILE"] = str(tmp / "models.toml")
    replicas = {}
    for name in ("r1", "r2", "r3"):
        extra = ["--state-dir", str(tmp / name)]
        env_r = env | {"KVSERVE_REPLICA_ID": name}
        proc, base = spawn_server(extra, env_r, log=tmp / f"{name}.log", own_group=True)
        SPAWNED.append(proc)  # ended with the others, its process group whole
        replicas[name] = (proc, base.removesuffix("/v1"))
        print(f"replica {name} ready at {replicas[name][1]}", flush=True)
    nginx = Nginx(tmp / "nginx", [int(b.rsplit(":", 1)[1]) for _, b in replicas.values()])

    print("reference run (nothing dies)", flush=True)
    reference = run(nginx.base, client, "ref", args.sessions, args.turns)
    redis_bytes = sum(redis.client.strlen(k) for k in redis.client.scan_iter("kvserve:blk:*"))
    num_blocks = len(list(redis.client.scan_iter("kvserve:blk:*")))
    system_tokens = system_prompt_tokens(nginx.base)

    victim = rng.choice(sorted({c.rows[0]["replica"] for c in reference}))  # one that is home to sessions
    kill_after = rng.randint(args.sessions + 1, args.sessions * (args.turns - 1))  # in round 2 to the last but one
    killed = {"victim": victim, "after": kill_after, "at": 0.0}
    t0 = time.perf_counter()

    def maybe_kill(num_done: int) -> None:  # called with client.lock held
        if num_done == kill_after:
            os.killpg(replicas[victim][0].pid, signal.SIGKILL)  # the replica and anything it started
            killed["at"] = time.perf_counter() - t0
            client.in_flight_at_kill = set(client.in_flight)
            print(f"SIGKILL {victim} after {num_done} turns, {len(client.in_flight)} in flight", flush=True)

    print("failover run", flush=True)
    failover = run(nginx.base, client, "run", args.sessions, args.turns, maybe_kill)
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
    nginx_log = (tmp / "nginx" / "nginx.log").read_text(errors="replace")
    redis_stats = (redis_bytes, num_blocks)
    return reference, failover, restored, recompute, turns_recorded, redis_stats, system_tokens, killed, nginx_log


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
