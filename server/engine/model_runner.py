"""The model runner: the model, its K/V pool, and one packed forward pass per step.

It owns the pool's tensors: a step's forward pass writes the new tokens' K/V, and at admission it
writes reused K/V into the blocks the scheduler gives (a snapshot's tokens, a partial block's copy).

The rows of a step are laid out as one packed row ([1, T]): input ids, positions, the pool
slot each new token's K/V goes to, and per sequence where its queries sit in the row and
where its context sits in the pool. transformers hands that metadata (a forward kwarg) to the
paged attention function of every layer (server/kv/attention.py); logits are computed for the
sampled positions only.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from server.engine.compiled import WARM_UP_TOKENS, CompiledModel
from server.engine.decode_graphs import (
    GRAPH_MAX_KEYS,
    CudaGraphRecorder,
    DecodeGraphs,
    GraphRecorder,
    StaticDecode,
    buckets_for,
)
from server.engine.fused_step import FusedDecode
from server.engine.scheduler import Row
from server.kv import kernels, offload
from server.kv.attention import StepMeta, attention_inputs, install, stepping
from server.kv.backends import (
    BACKENDS,
    KERNEL_BACKEND,
    SDPA_BACKEND,
    TILED_BACKEND,
    TRITON_BACKEND,
    AttentionBackend,
    BackendFacts,
    KernelBackend,
    SdpaBackend,
    StepRow,
    TiledBackend,
    TritonBackend,
    choose_backend,
)
from server.kv.head_layouts import HeadLayouts
from server.kv.pool import KVLayout, KVPool
from server.kv.routing import HEAD, KERNEL, SDPA, LoneRowRoute, time_lone_row, time_prefill
from server.kv.snapshot import Snapshot
from server.models.digest import ModelDigests
from server.models.loader import LoadedModel
from server.models.packed_linear import batch_invariance, decode_products, linear_invariance, pad_rows
from server.models.weight_bytes import weight_bytes
from server.startup import Startup

log = logging.getLogger("kvserve.engine")


@dataclass(slots=True)
class ForwardCounter:
    """Tokens fed to the model, by phase: the proof behind `cached_tokens` in tests."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_forwards: int = 0


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        budget_bytes: int,
        block_size: int,
        compile_dir: str | None = None,
        kv_dtype: torch.dtype | None = None,
        deterministic: bool = False,
        attention: str = "auto",
        graph_rows: int = 0,
        startup: Startup | None = None,
    ) -> None:
        """`kv_dtype`: the quantized format the pool stores K/V in (None: the compute dtype); `deterministic`: make
        a token's K/V and logits independent of the step it is computed in (`_deterministic`); `attention`: the
        backend (auto: `choose_backend`; triton on a CPU only under TRITON_INTERPRET=1, for tests); `graph_rows`:
        capture decode steps of up to this many rows as CUDA graphs (CUDA with the Triton backend; 0: none);
        `startup`: what may ask it to stop between its phases (kernels, compile, capture: StartupStopped)."""
        startup = startup or Startup()
        self.model = loaded.model
        self.device = loaded.device
        self.layout = KVLayout.of(loaded.model.config, loaded.dtype, kv_dtype)
        num_blocks = max(1, budget_bytes // (self.layout.bytes_per_token * block_size))
        self.pool = KVPool(self.layout, num_blocks, block_size, loaded.device)
        self.digests = loaded.digests or ModelDigests.of_loaded(loaded.model, loaded.tokenizer)
        self.fingerprint = self.layout.fingerprint(self.digests.text)
        self.counter = ForwardCounter()
        startup.enter("kernels")  # the CPU kernels built (once per machine) or loaded; the Triton kernels' self-test
        has_kernels = loaded.device.type == "cpu" and kernels.paged_decode_available()
        facts = BackendFacts(
            device=loaded.device.type,
            has_kernels=has_kernels,
            tiled_serves=has_kernels and kernels.paged_prefill_available(self.layout.dtype, self.layout.head_dim),
            is_quantized=self.layout.is_quantized,
            plain_layers=not {"sliding_window", "softcap"} & attention_inputs(loaded.model),
            deterministic=deterministic,
            has_triton=triton_available(),
        )
        name = choose_backend(facts) if attention == "auto" else _forced(attention, facts)
        self.deterministic, self.deterministic_detail = False, "off"
        if deterministic:
            decode_products(loaded.model, False)  # its probe measures oneDNN's products (another engine's model)
            self._deterministic(loaded, has_kernels, name)
        else:
            pad_rows(loaded.model, 1)
        # Decode steps' products by our kernel: outside deterministic mode (its sums are not oneDNN's)
        gemv = not self.deterministic and has_kernels and bool(torch.ops.kvserve.bf16_gemv_available())
        self.decode_products = decode_products(loaded.model, gemv)
        # What the model's weights hold once this engine's choices are made: fixed from here (one engine per model
        # in a server; an engine built later on the same model object turns the copies on or off for both)
        self.weights = weight_bytes(loaded.model)
        if self.decode_products:
            log.info(
                "model %s: %d linear layers take decode steps' rows by bf16_gemv", loaded.spec.id, self.decode_products
            )
        self.facts = facts
        self.backend = self._backend(loaded, name)
        log.info("model %s: attention by the %s backend: %s", loaded.spec.id, self.backend.name, self.backend.detail)
        startup.check()
        if self.deterministic:
            self.deterministic_detail = f"on: attention by the {self.backend.name} backend, {self.deterministic_detail}"
            log.info("model %s: deterministic mode %s", loaded.spec.id, self.deterministic_detail)
        install(loaded.model)
        # Decode steps by one call of the fused kernel (server/engine/fused_step.py) where the layers are Llama's
        self.fused: FusedDecode | None = None
        if self.deterministic:
            self.fused_detail = "off: deterministic mode"
        elif not facts.plain_layers:
            self.fused_detail = "off: its layers have a sliding window or a softcap"
        else:
            self.fused_detail = f"off: needs the kernel or tiled backend, not {self.backend.name}"
        if not self.deterministic and isinstance(self.backend, KernelBackend | TiledBackend) and facts.plain_layers:
            self.fused, why = FusedDecode.of(loaded.model, self.pool, tiled=isinstance(self.backend, TiledBackend))
            self.fused_detail = why if self.fused is not None else f"off: {why}"
            log.info("model %s: fused decode step %s", loaded.spec.id, self.fused_detail)
        # What runs the steps, said in GET /v1/models/{id}: the compiled graphs, or eager and why
        self.compiled: CompiledModel | None = None
        self.compile_detail = "not asked (--compile false)"
        if compile_dir is not None and self.deterministic:
            self.compile_detail = (
                "asked, but runs eager: deterministic mode (inductor's kernels are not batch-invariant)"
            )
            log.info("model %s: not compiled: inductor's kernels are not batch-invariant", loaded.spec.id)
        elif compile_dir is not None:
            self.compiled, self.compile_detail = _compiled(loaded, compile_dir, startup)
        self.no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=loaded.device)  # steps read no mask
        self.graphs: DecodeGraphs | None = None
        self.graphs_detail = "not asked (cuda_graphs false)" if not graph_rows else "CUDA only, with the Triton backend"
        if graph_rows and loaded.device.type == "cuda" and isinstance(self.backend, TritonBackend):
            self._capture(loaded, graph_rows, startup)

    def _capture(
        self, loaded: LoadedModel, max_rows: int, startup: Startup, recorder: GraphRecorder | None = None
    ) -> None:
        """Decode steps of each bucket up to `max_rows` rows captured as CUDA graphs (server/engine/decode_graphs.py);
        a failed capture leaves every step eager, with the reason logged and said in GET /v1/models/{id}. A stop
        asked meanwhile raises StartupStopped between two buckets (`recorder`: CUDA's, or a test's stand-in)."""
        assert isinstance(self.backend, TritonBackend)
        startup.enter("capture")
        self.graphs = static_decode_graphs(self, loaded, buckets_for(max_rows))
        try:
            self.graphs.capture(recorder or CudaGraphRecorder(loaded.device), startup)
        except Exception as exc:
            log.exception(
                "model %s: capturing decode steps as CUDA graphs failed; every step runs eager", loaded.spec.id
            )
            self.graphs = None
            self.graphs_detail = "capture failed, every step eager: " + " ".join(f"{type(exc).__name__}: {exc}".split())
            return
        sizes = ", ".join(map(str, self.graphs.sizes))
        self.graphs_detail = f"decode steps of {sizes} rows, captured at start in {self.graphs.stats.capture_s:.2f} s"
        log.info("model %s: %s", loaded.spec.id, self.graphs_detail)

    def _backend(self, loaded: LoadedModel, name: str) -> AttentionBackend:
        """The chosen backend, built: the tiled one times SDPA against its prefill kernel for chunks (not in
        deterministic mode: one arithmetic for every row); the kernel one times a lone long row's ways."""
        text = loaded.model.config.get_text_config(decoder=True)
        num_heads = int(text.num_attention_heads)
        if name == SDPA_BACKEND:
            return SdpaBackend(self.pool)
        if name == TRITON_BACKEND:
            failed = TritonBackend.self_test(self.pool, num_heads)
            if failed is None:
                return TritonBackend(self.pool, every_token=self.deterministic)
            log.error("model %s: the Triton kernels do not run here (%s): attention by SDPA", loaded.spec.id, failed)
            sdpa = SdpaBackend(self.pool)
            sdpa.detail = f"every row one SDPA call (the Triton kernels do not run here: {failed})"
            if self.deterministic:
                self.deterministic = False
                self.deterministic_detail = "unavailable: the Triton kernels do not run here"
            return sdpa
        if name == TILED_BACKEND:
            layouts = HeadLayouts.for_pool(self.layout, self.pool.block_size, self.pool.nbytes)
            by_kernel = True
            if not self.deterministic:
                prefill = time_prefill(self.pool, num_heads)
                by_kernel = prefill.way == KERNEL
                log.info("model %s: %s", loaded.spec.id, prefill.describe)
            return TiledBackend(self.pool, by_kernel, layouts)
        assert name == KERNEL_BACKEND
        quantized, plain = self.facts.is_quantized, self.facts.plain_layers
        if self.deterministic:
            return KernelBackend(self.pool, KERNEL, uses_heads=False, every_token=True)
        uses_heads = not quantized and plain
        # Over a quantized pool the alternative to the prefill kernel is SDPA with a mask over the dequantized
        # context: 65 ms a layer for a 1,024-token chunk here; with the kernel (over a dequantized copy of the
        # chunk's blocks) a 2,000-token prefill took 1.8 s against 3.6 s.
        chunks_by_kernel = quantized and plain and self.facts.tiled_serves
        if quantized:  # every decode row to the kernel, which dequantizes the keys it reads
            return KernelBackend(self.pool, KERNEL, uses_heads=False, chunks_by_kernel=chunks_by_kernel)
        route: LoneRowRoute = time_lone_row(self.pool, num_heads)
        log.info("model %s: %s", loaded.spec.id, route.describe)
        lone = route.way if uses_heads or route.way != HEAD else min((KERNEL, SDPA), key=route.times_us.__getitem__)
        return KernelBackend(self.pool, lone, uses_heads)

    def _deterministic(self, loaded: LoadedModel, has_kernels: bool, backend: str) -> None:
        """Deterministic mode: a token's K/V and logits depend on its tokens alone, not on the step's other rows,
        where its prompt was cut into chunks or which K/V was cached (docs/architecture.md). Attention: the
        backend computes every row in one order that depends on its position only (the tiled backend does so
        always; the kernel and Triton backends send every token to their decode kernel, whose splits are fixed).
        The linear layers are made batch-invariant as measured (`batch_invariance`; on CUDA they are probed as
        they are, `linear_invariance`: cuBLAS picks its kernels by the row count)."""
        name = loaded.spec.id
        if backend == TRITON_BACKEND:
            ways = linear_invariance(loaded.model)
        else:
            ways = batch_invariance(loaded.model) if has_kernels else None
        if ways is None:
            kernel = backend == TRITON_BACKEND or has_kernels
            why = "needs the paged kernel" if not kernel else "its linear layers are not batch-invariant"
            self.deterministic_detail = f"unavailable: {why} on {loaded.device.type} in {loaded.dtype}"
            log.warning("model %s: deterministic mode %s", name, self.deterministic_detail)
            pad_rows(loaded.model, 1)
            return
        self.deterministic = True
        self.deterministic_detail = "linear products " + ", ".join(f"{n} {way}" for way, n in ways.items())

    def run(self, rows: list[Row], is_abandoned: Callable[[], bool] | None = None) -> torch.Tensor:
        """One forward pass over the rows; logits [R, V] for the rows that sample, in row order. `is_abandoned`,
        asked between layers, stops the pass (StepAbandoned) once nothing it computes is wanted."""
        if self.graphs is not None:
            replayed = self.graphs.run(rows)
            if replayed is not None:
                self._count(rows)
                return replayed
        meta, input_ids, position_ids, sampled_at = self._prepare(rows)
        fused = self.fused
        if (
            fused is not None
            and meta.decode is not None
            and fused.serves(meta.decode, int(input_ids.shape[1]), bool(meta.spans), meta.prefill is not None)
        ):
            with torch.inference_mode():
                fused_logits = fused.run(input_ids, position_ids, meta.slot_mapping, meta.decode, sampled_at)
            self._count(rows)
            return fused_logits
        meta.is_abandoned = is_abandoned
        with torch.inference_mode(), stepping(meta):
            if self.compiled is not None:
                logits: torch.Tensor = self.compiled(input_ids, position_ids, sampled_at)
            else:
                # A 4D mask passes through transformers as it is: no mask is built for a step (the paged attention
                # reads none), and no check of the positions for packed sequences (a device sync each step).
                out = self.model(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    attention_mask=self.no_mask,
                    use_cache=False,
                    logits_to_keep=sampled_at,
                )
                logits = out.logits[0]
        self._count(rows)
        return logits

    def write_snapshot(self, block_ids: list[int], snapshot: Snapshot, first: int, num_tokens: int) -> None:
        """The snapshot's tokens `first`..`num_tokens`-1 into these blocks (once its copy to the host landed)."""
        offload.restore(self.pool, block_ids, snapshot, first, num_tokens)

    def copy_slots(self, src_block: int, dst_block: int, num_slots: int) -> None:
        """A prompt diverging inside a cached block: its new block starts as a copy of the matching slots."""
        self.pool.copy_slots(src_block, dst_block, num_slots)

    def rest(self) -> None:
        """No rows this step (the engine waits for work): what the backend keeps across steps may go."""
        self.backend.rest()

    def _prepare(self, rows: list[Row]) -> tuple[StepMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed ids and positions, the slot mapping and the backend's plan of the step (blocks are allocated)."""
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        step_rows: list[StepRow] = []
        sampled_at: list[int] = []
        for row in rows:
            start = row.seq.num_computed
            end = start + len(row.token_ids)
            table = [b.block_id for b in row.seq.blocks]
            slots += self.pool.slot_ids(table, start, end)
            step_rows.append(StepRow(len(ids), len(row.token_ids), end, table, row.seq.blocks))
            ids += row.token_ids
            positions += range(start, end)
            if row.is_sampled:
                sampled_at.append(len(ids) - 1)
        meta = self.backend.plan(step_rows, torch.tensor(slots, dtype=torch.long, device=device))
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
        position_ids = torch.tensor([positions], dtype=torch.long, device=device)  # [1, T]
        return meta, input_ids, position_ids, torch.tensor(sampled_at, dtype=torch.long, device=device)

    def _count(self, rows: list[Row]) -> None:
        for row in rows:
            if row.seq.is_prefilled:
                self.counter.num_decode_tokens += len(row.token_ids)
            else:
                self.counter.num_prefill_tokens += len(row.token_ids)
        self.counter.num_forwards += 1


def static_decode_graphs(runner: ModelRunner, loaded: LoadedModel, sizes: tuple[int, ...]) -> DecodeGraphs:
    """A static decode step per bucket size over the runner's Triton backend, for rows of up to GRAPH_MAX_KEYS keys
    or the model's longest context (not captured yet: on a CPU they run eagerly)."""
    backend = runner.backend
    assert isinstance(backend, TritonBackend)
    text = loaded.model.config.get_text_config(decoder=True)
    layout, bs = runner.layout, runner.pool.block_size
    max_keys = min(loaded.max_context, GRAPH_MAX_KEYS)
    statics = [
        StaticDecode(
            loaded.model,
            backend,
            size,
            -(-max_keys // bs),
            max_keys,
            int(text.num_attention_heads),
            layout.head_dim,
            loaded.device,
        )
        for size in sizes
    ]
    return DecodeGraphs(statics, runner.pool.slot_ids)


def triton_available() -> bool:
    """triton can be imported here (the GPU kernels; on a CPU only the interpreter runs them)."""
    return importlib.util.find_spec("triton") is not None


def _forced(name: str, facts: BackendFacts) -> str:
    """A backend asked for by name: checked against what can run here."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: expected auto or one of {', '.join(BACKENDS)}")
    why = None
    if name == TRITON_BACKEND and not facts.has_triton:
        why = "triton is not installed"
    elif name == TRITON_BACKEND and facts.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        why = "on a CPU it runs only under TRITON_INTERPRET=1 (tests)"
    elif name in (KERNEL_BACKEND, TILED_BACKEND) and not facts.has_kernels:
        why = "it needs the CPU kernels, which are not built here"
    elif name == TILED_BACKEND and not (facts.tiled_serves and not facts.is_quantized and facts.plain_layers):
        why = "it serves bf16 pools on AVX512-BF16, head size 64 or 128, no window, softcap or 8-bit K/V"
    if why is not None:
        raise ValueError(f"attention backend {name!r}: {why}")
    return name


def _compiled(loaded: LoadedModel, cache_dir: str, startup: Startup) -> tuple[CompiledModel | None, str]:
    """The model compiled (both graphs, now), or None where it runs eager (with the reason logged); and what it
    runs, in words."""
    if loaded.device.type != "cpu":
        log.warning("model %s: not compiled: compiling is built for the CPU only (%s)", loaded.spec.id, loaded.device)
        return None, f"asked, but runs eager: compiling is built for the CPU only, not {loaded.device.type}"
    startup.enter("compile")
    compiled = CompiledModel(loaded.model, Path(cache_dir), loaded.spec.id)
    if not compiled.head_matches():
        log.warning("model %s: not compiled: its LM head does more than a linear layer and a softcap", loaded.spec.id)
        return None, "asked, but runs eager: its LM head does more than a linear layer and a softcap"
    try:
        compiled.compile(startup)
    except Exception as exc:  # a graph break, no C++ compiler, an inductor error: the model still serves, eager
        log.exception("model %s: not compiled: compiling failed; it runs eager", loaded.spec.id)
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return None, f"asked, but runs eager: compiling failed ({cause})"
    cached = f"{compiled.cache_hits} of {len(WARM_UP_TOKENS)} graphs from the cache"
    return compiled, f"compiled by torch.compile at start in {compiled.compile_s:.1f} s ({cached})"
