"""`kvserve serve ...` / `python -m server serve ...`, and `kvserve prepare` to convert models ahead."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import types
import typing
from pathlib import Path

from pydantic import ValidationError

from server.settings import Settings
from server.startup import Startup, StartupStopped
from server.stopping import StopSignals, draining_server, exit_now

if typing.TYPE_CHECKING:  # imported where they are used: torch, fastapi
    from server.http.auth import KeyRing
    from server.models.loader import ModelSpec

ENV_PREFIX = "KVSERVE_"  # Settings' (pydantic-settings reads KVSERVE_<FIELD>)
# An idle kept-alive connection is closed after this long. A proxy in front must let its own idle connections
# to the server go sooner (docker/scale/upstreams.conf: 4 s), or it may write a request into one being closed.
KEEP_ALIVE_S = 5
OPTIONS = {  # flag -> Settings field; absent flags keep the environment's or the default value
    "--host": "host",
    "--port": "port",
    "--model": "model",
    "--models-file": "models_file",
    "--cache-dir": "cache_dir",
    "--kv-budget-bytes": "kv_budget_bytes",
    "--block-size": "block_size",
    "--max-batch-tokens": "max_batch_tokens",
    "--max-queue": "max_queue",
    "--prefix-caching": "prefix_caching",
    "--compile": "compile",
    "--kv-dtype": "kv_dtype",
    "--deterministic": "deterministic",
    "--session-ttl-s": "session_ttl_s",
    "--default-max-tokens": "default_max_tokens",
    "--request-timeout-s": "request_timeout_s",
    "--shutdown-grace-s": "shutdown_grace_s",
    "--state-dir": "state_dir",
    "--host-kv-budget-bytes": "host_kv_budget_bytes",
    "--disk-kv-budget-bytes": "disk_kv_budget_bytes",
    "--host-kv-dtype": "host_kv_dtype",
    "--disk-kv-dtype": "disk_kv_dtype",
    "--shared-kv-dtype": "shared_kv_dtype",
    "--response-retention-s": "response_retention_s",
    "--api-keys-file": "api_keys_file",
    "--metrics-needs-key": "metrics_needs_key",
    "--max-request-bytes": "max_request_bytes",
    "--max-tokens-limit": "max_tokens_limit",
    "--max-sessions-per-tenant": "max_sessions_per_tenant",
    "--max-tenant-kv-bytes": "max_tenant_kv_bytes",
    "--max-unread-events": "max_unread_events",
    "--max-connections": "max_connections",
    "--header-timeout-s": "header_timeout_s",
    "--body-timeout-s": "body_timeout_s",
    "--log-prompts": "log_prompts",
    "--log-level": "log_level",
    "--replica-id": "replica_id",
    "--shared-url": "shared_url",
    "--shared-lease-s": "shared_lease_s",
}


def parse(argv: list[str]) -> tuple[str, Settings]:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("serve", "run the HTTP server"), ("prepare", "convert/load every model once, then exit")):
        cmd = sub.add_parser(name, help=help_text)
        for flag, field in OPTIONS.items():
            cmd.add_argument(flag, dest=field, default=None, help=Settings.model_fields[field].description)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    try:
        return args.command, Settings(**overrides)
    except ValidationError as exc:  # a flag's, the environment's or .env's value: one line each, as argparse would
        for line in refusals(exc):
            print(line, file=sys.stderr)
        raise SystemExit(2) from None


def refusals(exc: ValidationError) -> list[str]:
    """One line per setting refused: its flag and KVSERVE_ name, the value given, and what it may be."""
    lines, seen = [], set()
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        if field in seen:  # a union's members each refuse it: one line says what all of them allow
            continue
        seen.add(field)
        names = setting_names(field)
        given = repr(error.get("input"))
        given = given if len(given) <= 80 else given[:77] + "..."
        allowed = allowed_values(field)
        why = f"not one of {', '.join(allowed)}" if allowed else f"not valid: {error['msg']}"
        lines.append(f"kvserve: {names}: {given} is {why}")
    return lines


def allowed_values(field: str) -> list[str] | None:
    """The values an enumerated setting (Literals, booleans) may take, as they are written; None for others."""
    info = Settings.model_fields.get(field)
    if info is None:
        return None
    allowed: list[str] = []
    for member in typing.get_args(info.annotation) if _is_union(info.annotation) else (info.annotation,):
        if typing.get_origin(member) is typing.Literal:
            allowed += [str(value) for value in typing.get_args(member)]
        elif member is bool:
            allowed += ["true", "false"]
        else:
            return None
    return allowed


def _is_union(annotation: object) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def keep_triton_cache(cache_dir: Path) -> None:
    """Triton's compiled kernels (a GPU's attention) kept beside the converted weights, under cache_dir/triton,
    unless TRITON_CACHE_DIR says where: not in ~/.triton, which every checkout and install of one user shares."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(cache_dir).resolve() / "triton"))


def hide_broken_triton() -> None:
    """triton is optional (the GPU's attention kernels). One installed that does not import whole (triton, then
    triton.language) breaks torch's compiler, which transformers imports with its models: every start, on any
    device, `--compile` or not. Such a triton is hidden from this process (None in sys.modules: importing it raises
    ImportError, which torch, transformers and the backends take for "not installed"), and one line says what is
    off. Before anything imports it."""
    if importlib.util.find_spec("triton") is None:
        return
    try:
        importlib.import_module("triton.language")
    except Exception as exc:  # whatever a broken install raises while it is imported
        for name in [name for name in sys.modules if name == "triton" or name.startswith("triton.")]:
            del sys.modules[name]
        sys.modules["triton"] = None  # type: ignore[assignment]  # the import system reads None as "absent"
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        logging.getLogger("kvserve").warning(
            "triton is installed but does not import (%s): off, as if not installed (the Triton kernels; CUDA "
            "attention by SDPA)",
            why,
        )


def main(argv: list[str] | None = None) -> int:
    command, settings = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hide_broken_triton()
    if command == "prepare":
        return _prepare(settings)
    try:
        startup = Startup.from_environment()
    except ValueError as exc:  # the test hook's variable, mistyped
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    with StopSignals(startup) as signals:
        return _serve(settings, startup, signals)


def _serve(settings: Settings, startup: Startup, signals: StopSignals) -> int:
    """`kvserve serve`: 0 once stopped by a signal (in any phase), 1 when no model could be loaded, 2 for a setting
    it cannot take (docs/deploy.md)."""
    from server.engine.threads import confine_to_one_team

    confine_to_one_team()  # before torch is imported: one OpenMP team, the engine's (server/engine/threads.py)
    keep_triton_cache(settings.cache_dir)
    keys, refused = _tried_settings(settings)
    for line in refused:
        print(line, file=sys.stderr)
    specs = _specs(settings) if not refused else None
    if specs is None:  # refused, or the models file (said by _specs)
        return 2
    import uvicorn

    from server.app import create_app
    from server.http.connections import ConnectionGuard, default_max_connections, raise_descriptor_limit

    log = logging.getLogger("kvserve")
    app = create_app(settings, specs, keys, startup)
    limit = raise_descriptor_limit()
    guard = ConnectionGuard(settings.max_connections or default_max_connections(limit), settings.header_timeout_s)
    log.info("at most %d open connections", guard.max_connections)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=1,
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=False,  # the gate writes one line per request, with its ids
        http=guard.protocol(),
    )
    server = draining_server()(config, app, settings.shutdown_grace_s, signals)
    try:
        startup.enter("app")
    except StartupStopped:  # a signal since the settings were read: nothing started yet, nothing to save
        log.info("stopped before serving")
        return 0
    server.run()
    code = 0
    if server.failures:  # no model loaded: say why and exit non-zero, so an orchestrator restarts the process
        for reason in server.failures.values():  # each names its model, its source and the cause, on one line
            print(f"kvserve: {reason}", file=sys.stderr)
        code = 1
    host = getattr(app.state, "host", None)
    running = host.running_threads if host is not None else []
    if running:  # a phase that did not stop within the grace period (a compile, a kernel build, a download)
        log.warning("%s still running: exiting without waiting for it", ", ".join(running))
        exit_now(code)
    return code


def setting_names(field: str) -> str:
    """How an operator sets a field: its flag and its KVSERVE_ variable (the variable alone where there is no
    flag)."""
    flags = {name: flag for flag, name in OPTIONS.items()}
    return f"{flags[field]} ({ENV_PREFIX}{field.upper()})" if field in flags else f"{ENV_PREFIX}{field.upper()}"


def _tried_settings(settings: Settings) -> tuple[KeyRing | None, list[str]]:
    """The settings only trying them checks: the API keys (a file read) and the shared store (a URL Redis'
    client takes, a Redis that never evicts records). The keys, and one line per setting refused."""
    from server.http.auth import KeysRefused, load_keys

    keys, lines = None, []
    try:
        keys = load_keys(settings.api_keys, settings.api_keys_file)
    except KeysRefused as exc:
        lines.append(f"kvserve: {' and '.join(setting_names(s) for s in exc.settings)}: {exc}")
    return keys, lines + _shared_store_refusals(settings)


def _shared_store_refusals(settings: Settings) -> list[str]:
    if not settings.shared_url:  # one process: no Redis, not even its client
        return []
    import redis

    from server.sessions.shared import EvictingStore, SharedRecords, refuse_evicting_store

    lines = []
    for field in ("shared_url", "shared_blocks_url"):
        url = getattr(settings, field)
        try:
            redis.Redis.from_url(url) if url else None
        except ValueError as exc:
            lines.append(f"kvserve: {setting_names(field)}: {url!r} is not valid: {exc}")
    if lines or not settings.shared_url:
        return lines
    records = SharedRecords(settings.shared_url)
    try:
        refuse_evicting_store(records)  # a Redis that does not answer is warned about: it may come up later
    except EvictingStore as exc:
        lines.append(f"kvserve: {setting_names('shared_url')}: {exc}")
    finally:
        records.close()
    return lines


def _specs(settings: Settings) -> list[ModelSpec] | None:
    """What to serve (--model, else the models file), or None when the models file cannot be read: said in one
    line, as a bad setting is."""
    from server.hosting import resolve_specs

    try:
        return resolve_specs(settings)
    except (OSError, ValueError, TypeError) as exc:  # missing, not TOML, unknown or missing keys, a bad kv_dtype
        print(f"kvserve: --models-file ({ENV_PREFIX}MODELS_FILE): {exc}", file=sys.stderr)
        return None


def _prepare(settings: Settings) -> int:
    from server.kv import kernels
    from server.models.loader import ModelLoadError, load_model

    specs = _specs(settings)
    if specs is None:
        return 2
    status = 0
    if kernels.paged_decode_available():  # built now, not on the first start
        print(f"paged decode kernel: built ({kernels.build_name()})")
    else:
        print(f"paged decode kernel: unavailable ({kernels.unavailable_reason()}); the SDPA path serves")
    for spec in specs:
        try:
            loaded = load_model(spec, settings.cache_dir)
            dtype = f"{loaded.dtype} ({loaded.dtype_reason})"
            print(f"{spec.id}: ready ({loaded.device}, {dtype}, context {loaded.max_context})")
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
