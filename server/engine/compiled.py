"""The model's dense part compiled by inductor: norms, rotary, projections, MLP, residual adds and the
element-wise ops between them, fused into generated CPU code with the Python around them gone.

What is compiled is the model's decoder (transformers' base model), called as the runner calls it:
a packed row of input ids and positions ([1, T], tensors only). Two things stay opaque to inductor,
custom ops it calls without looking in: attention (`kvserve::step_attention`, which reads the step's
metadata when it runs, server/kv/attention.py) and the oneDNN-packed linear layers
(`kvserve::packed_linear`, server/models/packed_linear.py). So no Python object of a step meets a
guard, and the graph holds no weight inductor cannot cache.

The token count is a symbolic size: one graph serves every step of 2 or more tokens and a second one
the single-token step (torch specialises a size of 1), with no padding. Both are compiled at start,
before the model reports ready, by two warm-up forwards outside any step (attention then is plain
causal attention over the tokens given). Inductor keeps its artifacts under the cache directory, so a
restart skips the code generation (it still traces the model). Once compiled, a step whose inputs
would need another graph runs eager instead of stalling the engine for a compile (and is counted):
torch's `fail_on_recompile` stance refuses it where the guards are checked, before any of it runs.
The stance is process-wide, so with several compiled models their calls take turns (`STANCE`).

The LM head and a final logit softcap are applied eager, to the sampled rows only; a model whose head
does something else (found by comparing with its own forward at start) is not compiled.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from server.engine.threads import compute_threads
from server.kv.attention import current_step
from server.startup import Startup

log = logging.getLogger("kvserve.engine")
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
WARM_UP_TOKENS = (1, 2)  # a one-token graph and the symbolic one
RECOMPILE_ERROR = "Detected recompile"  # how torch's "fail_on_recompile" stance says no graph fits
# torch's compile stance is one process-wide setting: the compiled models' calls and compiles take turns with it
STANCE = threading.Lock()


class CompiledModel:
    """A causal LM's decoder compiled; called as (input ids [1, T], positions [1, T], sampled rows [S]) -> [S, V]."""

    def __init__(self, model: Any, cache_dir: Path, model_id: str) -> None:
        self.model, self.model_id, self.cache_dir = model, model_id, cache_dir / "inductor"
        self.body: torch.nn.Module = model.base_model
        self.head: torch.nn.Module = model.get_output_embeddings()
        text = model.config.get_text_config(decoder=True)
        self.softcap: float | None = getattr(text, "final_logit_softcapping", None)
        self.device = next(model.parameters()).device
        self.num_steps = 0
        self.num_graph_steps = 0  # of those, the ones whose attention ran as the graph's op
        self.num_eager_steps = 0  # of those, the ones that ran eager: their inputs wanted a graph not compiled at start
        self.compile_s = 0.0
        self.cache_hits = 0
        self.num_threads = compute_threads()  # what the graphs are built and run under (dynamo guards it)
        self._compiled: Callable[..., Any] = torch.compile(self.body, dynamic=True, fullgraph=True)

    def head_matches(self) -> bool:
        """Whether the eager decoder plus `_logits` gives the model's own logits (no other head transform)."""
        ids = torch.tensor([[1, 2, 3]], device=self.device)
        with torch.inference_mode():
            expected = self.model(input_ids=ids, use_cache=False).logits[0]
            hidden = self.body(input_ids=ids, use_cache=False).last_hidden_state
            got = self._logits(hidden, torch.arange(3, device=self.device))
        return bool(torch.equal(got, expected))

    def compile(self, startup: Startup | None = None) -> None:
        """Compile both graphs now (warm-up forwards outside any step); logs the time and the cache's share.
        `startup` is asked before each graph whether to stop (StartupStopped)."""
        os.environ[CACHE_ENV] = _cache_dir(self.cache_dir)
        hits_before = counters["aot_autograd"]["autograd_cache_hit"]
        start = time.perf_counter()
        # Under the engine thread's thread count: the graphs' guards hold it, and a graph compiled under another
        # count (a caller's thread left at 1) is never used: every step would run eager.
        before = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            for n in WARM_UP_TOKENS:  # inputs made as the runner makes them: outside inference mode, not views
                if startup is not None:
                    startup.check()
                ids = torch.tensor([[1] * n], dtype=torch.long, device=self.device)
                positions = torch.tensor([list(range(n))], dtype=torch.long, device=self.device)
                with STANCE, torch.compiler.set_stance("default"), torch.inference_mode():
                    self._compiled(input_ids=ids, position_ids=positions, use_cache=False)
        finally:
            torch.set_num_threads(before)
        self.compile_s = time.perf_counter() - start
        self.cache_hits = counters["aot_autograd"]["autograd_cache_hit"] - hits_before
        log.info(
            "model %s: compiled in %.1f s (%d of %d graphs from the cache in %s)",
            self.model_id,
            self.compile_s,
            self.cache_hits,
            len(WARM_UP_TOKENS),
            os.environ[CACHE_ENV],
        )

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, sampled_at: torch.Tensor) -> torch.Tensor:
        """One step's forward (inside `stepping`, once compiled): the graph, or eager where none fits."""
        step = current_step()
        calls = step.num_op_calls if step is not None else 0
        self.num_steps += 1
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
        if torch.get_num_threads() != self.num_threads:  # seen changed under the engine thread after graph calls
            torch.set_num_threads(self.num_threads)
        try:
            with STANCE, torch.compiler.set_stance("fail_on_recompile"):
                hidden = self._compiled(**inputs).last_hidden_state
        except RuntimeError as exc:  # raised on entry, where the guards are checked: nothing of the step has run
            ran = step is not None and step.num_op_calls != calls
            if ran or not str(exc).startswith(RECOMPILE_ERROR):
                raise
            if self.num_eager_steps == 0:
                why = " ".join(str(exc).split())[:600]
                log.warning(
                    "model %s: a %d-token step ran eager (no graph fits: %s)", self.model_id, input_ids.shape[1], why
                )
            self.num_eager_steps += 1
            return self._logits(self.body(**inputs).last_hidden_state, sampled_at)
        if step is not None and step.num_op_calls != calls:
            self.num_graph_steps += 1
        return self._logits(hidden, sampled_at)

    def _logits(self, hidden: torch.Tensor, sampled_at: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(hidden[0].index_select(0, sampled_at))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _cache_dir(ours: Path) -> str:
    """The cache directory the environment gives torch, else ours: never the machine's shared default under /tmp
    (which torch writes into the environment itself once its compiler is imported)."""
    given = os.environ.get(CACHE_ENV)
    if given is None or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        return str(ours)
    return given
