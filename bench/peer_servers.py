"""The servers bench/peers.py compares: how each is started, told its dtype, and stopped."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import ROOT, spawn_server

LABELS = {"kvserve-compiled": "kvserve compiled", "kvserve": "kvserve", "vllm": "vLLM", "hf": "transformers serve"}


def label(entry: str) -> str:
    """`vllm@bfloat16` -> `vLLM (bfloat16)`: a server, and the dtype it was told to compute in, if any."""
    name, _, dtype = entry.partition("@")
    return LABELS[name] + (f" ({dtype})" if dtype else "")


VLLM_ENV = {  # the environment's own VLLM_* values win
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_NO_USAGE_STATS": "1",
}
VLLM_METADATA = """
import importlib.metadata as m, pathlib, sysconfig
try:
    m.version("vllm")
except m.PackageNotFoundError:
    stub = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{m.version('vllm-cpu')}.dist-info"
    stub.mkdir()
    (stub / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {m.version('vllm-cpu')}+cpu\\n")
    print(f"added {stub}: vLLM's CLI reads the version of `vllm`, which vllm-cpu does not provide")
print(m.version("vllm-cpu"))
"""


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base: str
    model: str
    version: str
    dtype: str
    body: dict = field(default_factory=dict)  # merged into every chat request
    sessions: bool = False  # one kvserve session per conversation
    own_group: bool = True  # started in its own process group (vLLM's engine runs in a child process)
    deterministic: str | None = None  # kvserve's deterministic mode as it reports it ("on: ...", "off", ...)


def model_dir() -> Path:
    found = sorted((ROOT / "models" / "cache").glob("smollm2-135m-instruct-*"))
    if not found:
        raise RuntimeError("no models/cache/smollm2-135m-instruct-*: run `make install` (kvserve prepare) first")
    return found[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def launch(name: str, cmd: list[str], env: dict, log: Path, deadline_s: float) -> tuple[subprocess.Popen, str]:
    """Start `cmd --port P` in its own process group, output to `log`; wait until GET /health answers 200."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--port", str(port)],
            env={**env, **os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up ({log}):\n{log_tail(log)}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base + "/v1"
        time.sleep(1)
    stop_group(proc)
    raise RuntimeError(f"{name} not ready after {deadline_s:.0f} s ({log}):\n{log_tail(log)}")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL to whatever of it is left after 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop(server: Server) -> None:
    if server.own_group:
        stop_group(server.proc)
    else:
        server.proc.terminate()
        server.proc.wait(60)


def python_output(python: str, code: str) -> str:
    """The stdout of `python -c code` (another venv's interpreter); a RuntimeError with its stderr if it fails."""
    try:
        return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"{python}: {getattr(e, 'stderr', None) or e}") from e


def greedy_stream(server: Server, max_tokens: int, **fields: object) -> dict:
    """A request body for `server`: `fields` (messages or prompt), greedy, streamed with usage, the server's own
    extras (ignore_eos)."""
    return {
        "model": server.model,
        **fields,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **server.body,
    }


def start_kvserve_compiled(args, log: Path, dtype: str | None) -> Server:
    """kvserve with its model compiled at start (`--compile true`)."""
    return start_kvserve(args, log, dtype, {"KVSERVE_COMPILE": "true"})


def kvserve_overrides() -> dict[str, str]:
    """The KVSERVE_* settings a kvserve started here runs with besides the shipped defaults: this environment's,
    and those of a .env file in the source tree, which kvserve also reads (the environment wins)."""
    found = {}
    dotenv = ROOT / ".env"
    if dotenv.exists():
        for line in dotenv.read_text().splitlines():
            key, sep, value = line.strip().removeprefix("export ").partition("=")
            if sep and key.strip().upper().startswith("KVSERVE_"):
                found[key.strip()] = value.strip().strip("'\"")
    return found | {k: v for k, v in os.environ.items() if k.startswith("KVSERVE_")}


def start_kvserve(args, log: Path, dtype: str | None, env: dict | None = None) -> Server:
    """kvserve on its shipped defaults: no flag but --kvserve-args, no KVSERVE_* variable but the environment's
    (and .env's); NAME@DTYPE only points it at a copy of models.toml with that dtype."""
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    version = commit.stdout.strip()
    env = dict(env or {})
    if dtype:  # models.toml with this dtype instead of auto
        models = Path(f"/tmp/peers-models-{dtype}.toml")
        text = (ROOT / "models" / "models.toml").read_text()
        text = re.sub(r'(?m)^dtype = ".*"$', f'dtype = "{dtype}"', text)
        models.write_text(text)
        env["KVSERVE_MODELS_FILE"] = str(models)
    try:
        proc, base = spawn_server(shlex.split(args.kvserve_args), env=env, log=log)
    except RuntimeError as e:
        raise RuntimeError(f"kvserve: {e} ({log}):\n{log_tail(log)}") from e
    info = httpx.get(f"{base}/models/{args.model}").json()  # its dtype and deterministic mode are chosen at load
    print(f"kvserve: {info.get('dtype')}, {info.get('dtype_reason')}", flush=True)
    print(f"kvserve: deterministic mode {info.get('deterministic')}", flush=True)
    dtype = info.get("dtype") or "unknown"
    body = {"ignore_eos": True}
    server = Server("kvserve", proc, base, args.model, version, dtype, body, sessions=True, own_group=False)
    server.deterministic = info.get("deterministic") or "unknown"
    return server


def start_vllm(args, log: Path, dtype: str | None) -> Server:
    dtype = dtype or args.vllm_dtype
    *notes, version = python_output(args.vllm_python, VLLM_METADATA).splitlines()
    for note in notes:
        print(f"vllm: {note}", flush=True)
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir()),
        "--served-model-name",
        args.model,
        "--host",
        "127.0.0.1",
        "--dtype",
        dtype,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        *shlex.split(args.vllm_args),
    ]
    proc, base = launch("vllm", cmd, VLLM_ENV, log, args.vllm_deadline)
    return Server("vllm", proc, base, args.model, version, dtype, {"ignore_eos": True})


def start_hf(args, log: Path, dtype: str | None) -> Server:
    dtype = dtype or args.hf_dtype
    version = python_output(args.hf_python, "import transformers; print(transformers.__version__)").strip()
    model = str(model_dir())  # `transformers serve` names a local model by its path
    cmd = [args.hf_python, "-m", "transformers.cli.transformers", "serve", model, "--continuous-batching"]
    cmd += ["--host", "127.0.0.1", "--device", "cpu", "--dtype", dtype, "--cb-num-blocks", str(args.hf_blocks)]
    cmd += shlex.split(args.hf_args)
    proc, base = launch("hf", cmd, {}, log, args.hf_deadline)
    # It answers 422 to `ignore_eos`: a request's own generation config with EOS id -1 (none) does the same.
    body = {"generation_config": json.dumps({"eos_token_id": -1})}
    return Server("hf", proc, base, model, version, dtype, body)


STARTERS = {"kvserve": start_kvserve, "kvserve-compiled": start_kvserve_compiled, "vllm": start_vllm, "hf": start_hf}
