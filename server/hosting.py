"""The served models: loaded in the background (so /ready can say 503 meanwhile), one engine each,
over one session store and one set of K/V tiers.

Shutting down while models load (server/startup.py): the loading thread is asked to stop at its next safe point
and `close` waits for it, up to the grace period counted from the request; a thread still running then is
reported by `running_threads`, and the process exits without the interpreter's finalization (server/__main__.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from server import memory
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.threads import use_compute_threads
from server.kv.block_store import KNOWN_LIMIT, BlockStore
from server.kv.fingerprints import FingerprintBoard
from server.kv.redis_blocks import RedisBlocks
from server.kv.tiers import TierFormats, TierStore
from server.models.loader import LoadedModel, ModelLoadError, ModelSpec, load_model, read_specs, spec_from_cli
from server.sessions.errors import SharedStoreUnavailable
from server.sessions.journal import Journal
from server.sessions.leases import RedisLeases
from server.sessions.shared import SharedRecords
from server.sessions.shared_state import SharedStoreState
from server.sessions.store import SessionStore
from server.settings import Settings, default_host_kv_budget, default_kv_budget
from server.startup import Startup, StartupStopped

log = logging.getLogger("kvserve")
MAX_SHARED_JOBS = 256  # turns' blocks waiting for Redis; past this a turn is not shared (only colder elsewhere)


@dataclass(slots=True)
class ModelState:
    spec: ModelSpec
    status: str = "pending"  # pending | loading | ready | failed | stopped (start-up stopped before it was ready)
    detail: str = ""


class ModelHost:
    def __init__(
        self, settings: Settings, specs: list[ModelSpec] | None = None, startup: Startup | None = None
    ) -> None:
        """`startup`: the start-up's phases and its stop (`kvserve serve` passes the one its signals stop)."""
        self.settings = settings
        self.startup = startup or Startup()
        specs = specs if specs is not None else resolve_specs(settings)
        self.states = {s.id: ModelState(s) for s in specs}
        self.engines: dict[str, Engine] = {}
        state = settings.state_dir
        host_budget = settings.host_kv_budget_bytes
        if host_budget is None:
            host_budget = default_host_kv_budget(_likely_device(specs), _total_ram())
        kv_dir = state / "kv" if state else None
        formats = TierFormats(settings.host_kv_dtype, settings.disk_kv_dtype, settings.shared_kv_dtype)
        self.tiers = TierStore(host_budget, settings.disk_kv_budget_bytes, kv_dir, settings.block_size, formats)
        journal = Journal(state / "sessions" if state else None)
        leases, shared = None, None
        self.redis_blocks: RedisBlocks | None = None
        self.fingerprints: FingerprintBoard | None = None  # which K/V fingerprint each replica serves a model with
        shared_state = None
        if settings.shared_url:  # replicas: turns leased and records committed in Redis
            shared_state = SharedStoreState(settings.shared_resolve_s)  # one view of Redis: leases and records
            leases = RedisLeases(settings.shared_url, settings.shared_lease_s, state=shared_state)
            shared = SharedRecords(settings.shared_url, state=shared_state)  # an evicting one: refused by main
            self.redis_blocks = RedisBlocks(settings.shared_blocks_url or settings.shared_url)
            self.tiers.shared = blocks = BlockStore(self.redis_blocks, "shared", MAX_SHARED_JOBS, KNOWN_LIMIT)
            redis_blocks = self.redis_blocks
            self.fingerprints = FingerprintBoard(redis_blocks.client, redis_blocks.errors, settings.replica_id)
            shared_state.on_epoch_change(blocks.forget_known)  # blocks Redis lost are stored again
            self.redis_blocks.watch(blocks.forget_known)  # and those of a Redis of their own
        self.store = SessionStore(
            settings.session_ttl_s,
            journal=journal,
            forgetters=(self.tiers,),
            leases=leases,
            shared=shared,
            max_sessions_per_tenant=settings.max_sessions_per_tenant,
        )
        num_sessions = self.store.restore()
        if shared_state is not None:  # a copy of another epoch than Redis' is one Redis lost: it goes, never back
            shared_state.on_epoch_change(lambda: self.store.drop_other_epochs(shared_state.held_epoch()))
            self.store.drop_other_epochs(self._shared_epoch())
        num_snapshots = self.tiers.scan(self.store.session_keys())  # K/V of sessions no record knows goes
        if state:
            log.info("state in %s: %d sessions and %d K/V snapshots found", state, num_sessions, num_snapshots)
        self._thread = threading.Thread(target=self._load_all, name="model-loader", daemon=True)
        self.is_draining = False

    def start(self) -> None:
        self._thread.start()

    def _shared_epoch(self) -> str | None:
        """Redis' epoch now (None when it does not answer: copies are then checked as they are used)."""
        assert self.store.shared is not None
        try:
            return self.store.shared.epoch()
        except SharedStoreUnavailable:
            log.warning("the shared store does not answer at start: this replica's copies are checked as they are used")
            return None

    def wait_loaded(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    @property
    def is_ready(self) -> bool:
        """Every model has either loaded or failed, and at least one loaded: what there is, is served."""
        statuses = [s.status for s in self.states.values()]
        return "ready" in statuses and all(status in ("ready", "failed") for status in statuses)

    @property
    def has_failed(self) -> bool:
        """Every model failed to load: nothing will ever be served (`kvserve serve` exits, to be restarted)."""
        return bool(self.states) and all(s.status == "failed" for s in self.states.values())

    @property
    def failures(self) -> dict[str, str]:
        """Each model that failed to load, and why."""
        return {model_id: s.detail for model_id, s in self.states.items() if s.status == "failed"}

    @property
    def num_active(self) -> int:
        return sum(engine.num_active for engine in list(self.engines.values()))

    @property
    def running_threads(self) -> list[str]:
        """The threads of this host that compute with torch and still run (after `close`: the ones that did not
        stop in time, which the interpreter's exit must not meet inside torch)."""
        running = [self._thread.name] if self._thread.is_alive() else []
        return running + [f"engine-{model_id}" for model_id, engine in list(self.engines.items()) if engine.is_running]

    def begin_drain(self) -> None:
        """SIGTERM: new requests answer 503, the ones running may finish; models still loading stop loading."""
        self.is_draining = True
        self.startup.stop()
        log.info("draining: %d requests still running", self.num_active)

    def close(self) -> None:
        """Stop loading (waiting for the loading thread's next safe point, up to the grace period) and the engines;
        write every live session record again (a state directory removed meanwhile comes back), then every
        session's K/V; say what could not be written."""
        self.is_draining = True
        self._stop_loading()
        engines = list(self.engines.values())
        for engine in engines:
            engine.close()  # all at once: each finishes its current step in parallel
        for engine in engines:
            engine.stop()
        if self.fingerprints is not None:
            self.fingerprints.close()  # before its Redis client closes with the shared tier
        num_records, unsaved = self.store.save_all()
        if unsaved:
            names = ", ".join(key.name for key in unsaved[:20])
            log.error("could not write the records of %d sessions (they are lost at restart): %s", len(unsaved), names)
        saved, failed_before = 0, self.tiers.totals().num_failed_writes
        for engine in engines:
            try:
                saved += engine.save_sessions()
            except Exception:
                log.exception("saving the K/V of model %s failed; its sessions will recompute", engine.model_id)
        self.tiers.flush()
        self.tiers.close()
        if self.tiers.shared is not None:
            self.tiers.shared.close()
        self.store.leases.close()
        if self.store.shared is not None:
            self.store.shared.close()
        failed = self.tiers.totals().num_failed_writes - failed_before
        if self.settings.state_dir:
            log.info(
                "saved %d session records and the K/V of %d sessions to %s (%d K/V snapshots could not be written)",
                num_records,
                saved - failed,
                self.settings.state_dir,
                failed,
            )

    def _stop_loading(self) -> None:
        """Ask the loading thread to stop and wait for it: at most the grace period, counted from the first request
        to stop (a signal's drain has counted already)."""
        self.startup.stop()
        if self._thread.ident is None or not self._thread.is_alive():  # never started, or done
            return
        assert self.startup.stop_time is not None
        left = self.startup.stop_time + self.settings.shutdown_grace_s - time.monotonic()
        log.info("waiting up to %.0f s for start-up to stop (phase %s)", max(0.0, left), self.startup.phase)
        self._thread.join(max(0.0, left))
        if self._thread.is_alive():
            log.warning("start-up did not stop within the grace period (phase %s)", self.startup.phase)

    def _load_all(self) -> None:
        """Load every model in turn. Whatever goes wrong with one (its files, its engine) marks it failed with the
        reason and the next one loads: no exception leaves a model "loading" for ever. A stop asked meanwhile
        (StartupStopped) marks the models not loaded yet "stopped" and ends the thread."""
        try:
            use_compute_threads()  # loading computes (digests, dtype timing, packing); the team ends with this thread
            for state in self.states.values():
                self.startup.check()
                state.status = "loading"
                log.info("loading model %s from %s", state.spec.id, state.spec.source)
                try:
                    self._load(state)
                except ModelLoadError as exc:  # says which model, from where, and why
                    state.status, state.detail = "failed", one_line(str(exc))
                    log.error("%s", exc)
                except Exception as exc:  # the engine's construction, or anything unforeseen: the trace helps
                    cause = f"{type(exc).__name__}: {exc}"
                    reason = f"model {state.spec.id!r} (source {state.spec.source}) failed to start: {cause}"
                    state.status, state.detail = "failed", one_line(reason)
                    log.exception("%s", reason)
        except StartupStopped:
            phase = self.startup.phase
            for state in self.states.values():
                if state.status in ("pending", "loading"):
                    state.status, state.detail = "stopped", f"not loaded: start-up stopped (phase {phase})"
            log.info("start-up stopped in phase %s: shutting down", phase)
        except BaseException as exc:  # outside one model's load (the threads' setup, an exit): the rest never load
            cause = f"{type(exc).__name__}: {exc}"
            for state in self.states.values():
                if state.status in ("pending", "loading"):
                    state.status, state.detail = "failed", one_line(f"model {state.spec.id!r} was not loaded: {cause}")
            log.exception("loading models stopped")
            raise

    def _load(self, state: ModelState) -> None:
        loaded = load_model(state.spec, self.settings.cache_dir, self.startup)
        loaded.guards_control_text = not self.settings.control_tokens_in_messages
        if self.settings.compile and loaded.device.type == "cpu":
            state.detail = "compiling the model (torch.compile; minutes the first time, cached after)"
        engine = Engine(loaded, self.store, self.tiers, self._engine_config(loaded), self.startup)
        self.startup.check()  # no engine thread starts once a stop was asked (close lists the engines after this)
        held = memory.process_rss()
        memory.release_freed()  # what loading freed (the checkpoint's tensors, the weights before packing) goes back
        rss = memory.process_rss()
        log.info(
            "model %s: holds %s; the process: %.0f MiB resident, after %.0f MiB the allocator kept free went back",
            state.spec.id,
            engine.resident().describe(),
            rss / 2**20,
            (held - rss) / 2**20,
        )
        engine.start()
        try:
            if self.fingerprints is not None:
                self.fingerprints.announce(state.spec.id, engine.fingerprint_parts | engine.shared_parts)
        except BaseException:
            engine.stop()  # a failed model serves nothing
            raise
        self.engines[state.spec.id] = engine
        state.status, state.detail = "ready", ""
        log.info("model %s ready on %s (%s)", state.spec.id, loaded.device, loaded.dtype)

    def _engine_config(self, loaded: LoadedModel) -> EngineConfig:
        s = self.settings
        budget = s.kv_budget_bytes
        if budget is None:
            free = _free_cuda(loaded.device) if loaded.device.type == "cuda" else None
            budget = default_kv_budget(loaded.device.type, free, _total_ram())
        compile_dir = str(s.cache_dir) if s.compile else None
        kv_dtype = loaded.spec.kv_dtype or s.kv_dtype
        deterministic = s.deterministic
        if deterministic == "auto":  # on where the model computes in 16 bits (bf16, fp16)
            deterministic = loaded.dtype.itemsize == 2
        return EngineConfig(
            budget,
            s.block_size,
            s.max_batch_tokens,
            s.max_queue,
            s.prefix_caching,
            compile_dir,
            kv_dtype,
            deterministic,
            cuda_graphs=s.cuda_graphs,
        )


def one_line(text: str, limit: int = 1000) -> str:
    """A reason as one line (an exception's message may span many), at most `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def resolve_specs(settings: Settings) -> list[ModelSpec]:
    if settings.model:
        return [spec_from_cli(settings.model)]
    return read_specs(Path(settings.models_file))


def _likely_device(specs: list[ModelSpec]) -> str:
    import torch

    wants_cuda = any(s.device in ("auto", "cuda") for s in specs)
    return "cuda" if wants_cuda and torch.cuda.is_available() else "cpu"


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _free_cuda(device) -> int:  # type: ignore[no-untyped-def]
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
