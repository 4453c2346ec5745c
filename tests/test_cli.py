"""`kvserve serve` / `prepare` refuse a bad setting in one line on stderr (its flag, its KVSERVE_ name, the value
and what it may be) and exit 2, as argparse does, never with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--kv-dtype", "int4", "not one of auto, compute, int8, fp8"),
        ("--host-kv-dtype", "fp4", "not one of pool, int8, fp8"),
        ("--disk-kv-dtype", "bf16", "not one of pool, int8, fp8"),
        ("--shared-kv-dtype", "fp16", "not one of pool, int8, fp8"),
        ("--deterministic", "maybe", "not one of auto, true, false"),
        ("--compile", "yes please", "not one of true, false"),
        ("--log-level", "loud", "not one of critical, error, warning, info, debug"),
        ("--block-size", "0", "not valid: Input should be greater than or equal to 1"),
        ("--port", "70000", "not valid: Input should be less than or equal to 65535"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "prepare"])
def test_a_bad_flag_is_one_line_and_exit_2(command, flag, value, allowed, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, flag, value])
    assert exited.value.code == 2
    env = "KVSERVE_" + flag.removeprefix("--").replace("-", "_").upper()
    assert capsys.readouterr() == ("", f"kvserve: {flag} ({env}): {value!r} is {allowed}\n")


def test_a_bad_environment_variable_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_SHARED_KV_DTYPE", "fp16")
    monkeypatch.setenv("KVSERVE_MAX_QUEUE", "-1")
    with pytest.raises(SystemExit) as exited:
        main(["serve"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [  # one line for each setting refused
        "kvserve: --max-queue (KVSERVE_MAX_QUEUE): '-1' is not valid: Input should be greater than or equal to 1",
        "kvserve: --shared-kv-dtype (KVSERVE_SHARED_KV_DTYPE): 'fp16' is not one of pool, int8, fp8",
    ]


def test_a_models_file_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, capsys):
    missing = tmp_path / "absent.toml"
    assert main(["prepare", "--models-file", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"kvserve: --models-file (KVSERVE_MODELS_FILE): [Errno 2] No such file or directory: '{missing}'\n"
    )
    unknown = tmp_path / "models.toml"
    unknown.write_text('[[models]]\nid = "x"\nsource = "."\nkv_dtype = "int4"\n')
    assert main(["prepare", "--models-file", str(unknown)]) == 2
    assert capsys.readouterr().err == (
        f"kvserve: --models-file (KVSERVE_MODELS_FILE): {unknown}: kv_dtype 'int4' in model 'x' is not one of "
        "auto, compute, int8, fp8\n"
    )


def test_kvserve_serve_with_a_bad_setting_exits_2_with_one_line_on_stderr(tmp_path):
    """The real process, as an operator starts it: no traceback, and no server started."""
    env = {**os.environ, "KVSERVE_HOST_KV_DTYPE": "int4"}
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--kv-dtype", "int4", "--port", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "kvserve: --kv-dtype (KVSERVE_KV_DTYPE): 'int4' is not one of auto, compute, int8, fp8",
        "kvserve: --host-kv-dtype (KVSERVE_HOST_KV_DTYPE): 'int4' is not one of pool, int8, fp8",
    ]


def test_triton_s_kernels_are_kept_in_the_cache_dir_unless_said_otherwise(tmp_path, monkeypatch):
    from server.__main__ import keep_triton_cache

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    keep_triton_cache(tmp_path / "cache")
    assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "cache").resolve() / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    keep_triton_cache(tmp_path / "cache")
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`kvserve serve ARGS` as an operator starts it, expected to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "server", "serve", "--port", "0", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_an_api_keys_file_that_is_missing_or_holds_no_key_is_one_line_and_exit_2(tmp_path):
    """Not a traceback and exit 1: keys configured but unusable are a bad setting like any other (and the server
    never starts open)."""
    keys = tmp_path / "keys.txt"
    names = "kvserve: --api-keys-file (KVSERVE_API_KEYS_FILE)"
    done = serve("--api-keys-file", str(keys))
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.splitlines() == [f"{names}: {str(keys)!r} cannot be read: No such file or directory"]
    keys.write_text("# no keys yet\n")
    done = serve("--api-keys-file", str(keys))
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.splitlines() == [f"{names}: API keys are configured but none was found in {str(keys)!r}"]
    done = serve(env={"KVSERVE_API_KEYS": "short:alice"})
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.splitlines() == [
        "kvserve: KVSERVE_API_KEYS: API keys are 8-512 characters of [A-Za-z0-9._~+/=-]"
    ]


def test_a_shared_store_url_redis_cannot_take_is_one_line_and_exit_2():
    done = serve("--shared-url", "http://redis:6379")
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.splitlines() == [
        "kvserve: --shared-url (KVSERVE_SHARED_URL): 'http://redis:6379' is not valid: Redis URL must specify one of "
        "the following schemes (redis://, rediss://, unix://)"
    ]


def test_the_children_of_this_process_are_found(tmp_path):
    """What `kvserve serve` asks to stop when it exits with a phase still running (a kernel build's ninja)."""
    from server.stopping import children as _children

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert child.pid in _children()
    finally:
        child.communicate(b"")
    assert child.pid not in _children()
