"""The engine on whatever device is here (CUDA when present), on a random-weight Llama-shaped model (no download).

What a first run on a GPU must establish, every figure timed inside one generation (never as the difference of
two runs), and printed as "n/a" where it cannot be measured (the CUDA graphs' column on a CPU, which captures
none; device memory on a CPU):

1. load: the model built on the device; each engine's start (the Triton self-test, which compiles the kernels
   on a cold cache, and the CUDA graphs' capture, timed on its own); the pool (tokens and GiB) and the peak
   device memory allocated (`torch.cuda.max_memory_allocated`);
2. greedy agreement with HF: --agree-prompts prompts continued greedily by the engine (all at once) and by HF
   eager `generate` in the compute dtype, both compared with HF on the same weights in a wider dtype (float32 for
   bf16, float64 for float32): tokens before the first difference. HF's own rounding is measured on the first
   token's logits (the largest difference between its two dtypes); a first difference of the engine where the
   reference's best two logits are more than twice that apart is an error, not rounding, and fails the run;
3. prefill: one prompt of each --prefill length, nothing cached, one token out: tokens/s and TFLOP/s (2 FLOP per
   parameter and token outside the embedding, causal attention's 2 x layers x T^2 x width, the logits of the one
   sampled position);
4. decode at each --batches size, CUDA graphs on and off, over the time every row decodes (from the last row's
   first token to the first row's last): aggregate tok/s (all rows' tokens in it, over it) and per stream (the
   median row's); at batch 1, (tokens - 1) / (last token's time - first's); batch 1 against the memory roofline
   (the bytes a step reads, weights + K/V, over --peak-gbps);
5. a long context (--long-tokens): time to first token and decode tok/s, graphs on and off;
6. a session's turn 2 with and without its cached K/V (time to first token).

The tokenizer is one word per token id (the model's whole vocabulary), so every sampled token is text at once
and reaches the client as its own event, timed as it arrives. With --json the figures are also written there
(rates as numbers, null where the printout says n/a). Run by bench/gpu_check.sh.

    python bench/gpu_check.py --shape 1b        # Llama-3.2-1B shape (on a GPU)
    python bench/gpu_check.py --shape small     # a few-MB model: proves the script on a CPU (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.engine.config import EngineConfig  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.engine.handle import RequestHandle  # noqa: E402
from server.engine.request import Admitted, Event, Failed, GenerationRequest, SamplingParams, TextDelta  # noqa: E402
from server.kv.tiers import TierStore  # noqa: E402
from server.models.loader import LoadedModel, ModelSpec  # noqa: E402
from server.sessions.record import SessionKey  # noqa: E402
from server.sessions.store import SessionStore  # noqa: E402

SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32},
    "small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
}
KV_HEADS = {"1b": 8, "small": 2}
VOCAB = {"1b": 128256, "small": 512}
CONTEXT = {"1b": 32768, "small": 4096}  # the long context must fit
# The weights' spread: Llama's own 0.02 at the 1B shape, whose 16 layers then turn each context into other tokens;
# at the small shape 0.02 leaves the tied embedding in charge (every prompt continues with its last token, which
# any engine gets right), 0.2 makes the layers count (as in tests/tiny.py).
INIT_RANGE = {"1b": 0.02, "small": 0.2}
DEFAULTS = {  # per shape; each flag overrides its own
    "1b": {
        "prompt_tokens": 128,
        "max_tokens": 128,
        "prefill": [512, 2048, 8192],
        "long_tokens": 16000,  # with 128 out, inside the 16,384 keys a captured step serves (decode_graphs.py)
        "history_tokens": 2000,
        "agree_prompts": 8,
        "agree_tokens": 32,
        "kv_gib": 16,
    },
    "small": {
        "prompt_tokens": 32,
        "max_tokens": 16,
        "prefill": [64, 256],
        "long_tokens": 1024,
        "history_tokens": 256,
        "agree_prompts": 4,
        "agree_tokens": 8,
        "kv_gib": 1,
    },
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ChatML's: the only ids whose text is not shown
WORDS = ["<unk>", "system", "user", "assistant"]  # the template's roles are words too: nothing in a chat is unknown
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One word per id (ChatML's special tokens, the roles, then `w7` ... up to the vocabulary), split on
    whitespace: every id but the three special ones decodes to text of its own, so a generation's tokens are timed
    one by one as they arrive."""
    names = SPECIALS + WORDS
    vocab = {token: i for i, token in enumerate(names)} | {f"w{i}": i for i in range(len(names), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None)
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(shape: str) -> LlamaConfig:
    return LlamaConfig(
        **SHAPES[shape],
        num_key_value_heads=KV_HEADS[shape],
        vocab_size=VOCAB[shape],
        max_position_embeddings=CONTEXT[shape],
        initializer_range=INIT_RANGE[shape],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=SPECIALS.index("<|im_end|>"),
        pad_token_id=0,
    )


def random_llama(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The same weights every call (seeded), rounded to bf16 where that is the compute dtype: a wider copy holds
    the rounded values, so comparing the two measures arithmetic alone."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(shape))
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.eval()


def loaded_model(shape: str, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    spec = ModelSpec(id=f"random-{shape}", source="(built in memory)", dtype=str(dtype).removeprefix("torch."))
    return LoadedModel(
        spec=spec,
        model=model,
        tokenizer=word_tokenizer(VOCAB[shape]),
        device=device,
        dtype=dtype,
        vocab_size=VOCAB[shape],
        max_context=CONTEXT[shape],
        eos_ids=frozenset(),
    )


@dataclass(slots=True)
class Generation:
    """One request's events as they arrived: when it was submitted, each text event's time and token count."""

    start: float
    stamps: list[tuple[float, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.stamps[0][0] - self.start if self.stamps else None


async def generate(
    engine: Engine,
    prompts: list[list[int]],
    max_tokens: int,
    session: str | None = None,
    use_cache: bool = True,
) -> list[Generation]:
    """These prompts at once (all queued before any is read), greedy, EOS ignored, each to max_tokens. Every text
    event is timed in the engine thread as it hands the event over (a client sees it later by the event loop's
    delay, which at 64 streams on a busy CPU can bunch one stream's tokens together)."""
    key = SessionKey("default", session) if session else None
    queued = []
    for i, prompt in enumerate(prompts):
        request = GenerationRequest(
            request_id=f"r{i}-{time.monotonic_ns()}",
            prompt_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            session=key,
            kv_source=key,
            use_cache=use_cache,
        )
        run = Generation(time.perf_counter())
        handle = engine.submit(request)
        pushed: dict[int, float] = {}  # id(event) -> when the engine thread pushed it
        handle.push = timed(handle.push, pushed)  # type: ignore[method-assign]
        queued.append((run, handle, pushed))

    async def read(run: Generation, handle: RequestHandle, pushed: dict[int, float]) -> Generation:
        async for event in handle:
            if isinstance(event, Admitted):
                run.num_cached = event.num_cached
            elif isinstance(event, TextDelta) and event.token_ids:
                # an event pushed before the wrapper was in place (not a token: one comes after a forward pass)
                run.stamps.append((pushed.get(id(event), time.perf_counter()), len(event.token_ids)))
                run.token_ids += event.token_ids
            elif isinstance(event, Failed):
                raise RuntimeError(f"request failed: {event}")
        return run

    return list(await asyncio.gather(*(read(*q) for q in queued)))


def timed(push: Callable[[Event], None], pushed: dict[int, float]) -> Callable[[Event], None]:
    def timed_push(event: Event) -> None:
        pushed[id(event)] = time.perf_counter()
        push(event)

    return timed_push


def decoding_together(runs: list[Generation]) -> tuple[float, float] | None:
    """From the last row's first token to the first row's last: the time in which every row decodes (None when
    there is none: a row finished before another began)."""
    if any(not r.stamps for r in runs):
        return None
    since, until = max(r.stamps[0][0] for r in runs), min(r.stamps[-1][0] for r in runs)
    return (since, until) if until > since else None


def aggregate_tok_s(runs: list[Generation]) -> float | None:
    """The tokens of every row while all of them decode, over that time."""
    window = decoding_together(runs)
    if window is None:
        return None
    since, until = window
    return sum(n for r in runs for t, n in r.stamps if since < t <= until) / (until - since)


def per_stream_tok_s(runs: list[Generation]) -> float | None:
    """The median over rows of each row's tokens while all of them decode, over that time (one row: (tokens - 1)
    / (last token's time - first's))."""
    window = decoding_together(runs)
    if window is None:
        return None
    since, until = window
    return statistics.median(sum(n for t, n in r.stamps if since < t <= until) / (until - since) for r in runs)


def median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


def fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def prefill_flops(config: LlamaConfig, dense_params: int, tokens: int) -> float:
    """One prompt's prefill: the weights outside the embedding (2 FLOP a parameter and token), causal attention
    (QK^T and PV over T^2 / 2 pairs: 2 x layers x T^2 x heads x head size) and the one sampled position's logits."""
    width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    attention = 2 * config.num_hidden_layers * tokens * tokens * width
    return 2.0 * dense_params * tokens + attention + 2.0 * config.hidden_size * config.vocab_size


def gib(n: float) -> float:
    return n / 2**30


class Check:
    """The figures of one run, printed as they come and kept for --json."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        default = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, args.dtype or default)
        self.reference_dtype = torch.float64 if self.dtype == torch.float32 else torch.float32
        self.results: dict = {"shape": args.shape, "device": self.device.type, "dtype": str(self.dtype)}
        self.gen = torch.Generator().manual_seed(1)
        self.failures: list[str] = []

    def prompt(self, n: int) -> list[int]:
        return torch.randint(len(SPECIALS) + len(WORDS), VOCAB[self.args.shape], (n,), generator=self.gen).tolist()

    def peak_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None

    def new_engine(self, graphs: bool) -> tuple[Engine, dict]:
        """A fresh copy of the model (the engine routes its attention through the pool) and an engine over it."""
        gc.collect()  # the last engine's pool and model, which cycles may still hold
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        model = random_llama(self.args.shape, self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        built_s = time.perf_counter() - start
        loaded = loaded_model(self.args.shape, model, self.device, self.dtype)
        tiers = TierStore(0, 0, None)
        store = SessionStore(ttl_s=3600, forgetters=(tiers,))
        config = EngineConfig(
            budget_bytes=self.args.kv_gib << 30,
            max_batch_tokens=self.args.batch_tokens,
            max_queue=1024,
            cuda_graphs=graphs,
        )
        start = time.perf_counter()
        engine = Engine(loaded, store, tiers, config)
        started_s = time.perf_counter() - start
        runner = engine.runner
        pool = runner.pool
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        capture_s = runner.graphs.stats.capture_s if runner.graphs is not None else None
        facts = {
            "built_s": built_s,
            "started_s": started_s,
            "capture_s": capture_s,
            "attention": f"{runner.backend.name} ({runner.backend.detail})",
            "cuda_graphs": runner.graphs_detail,
            "weights_bytes": weights,
            "pool_tokens": pool.num_blocks * pool.block_size,
            "pool_bytes": pool.nbytes,
            "peak_bytes_at_start": self.peak_bytes(),
        }
        label = "on" if graphs else "off"
        print(f"engine, CUDA graphs {label}: model built in {built_s:.1f} s ({gib(weights):.2f} GiB of weights)")
        capture = "n/a" if capture_s is None else f"{capture_s:.2f} s"
        print(
            f"  started in {started_s:.1f} s, of which the CUDA graphs' capture {capture} (the rest: the pool and the"
        )
        print("  attention backend's choice and self-test, where Triton compiles its kernels on a cold cache)")
        print(f"  attention: {facts['attention']}")
        print(f"  cuda graphs: {runner.graphs_detail}")
        print(f"  pool: {facts['pool_tokens']} tokens in {pool.num_blocks} blocks, {gib(pool.nbytes):.2f} GiB", end="")
        at_start = facts["peak_bytes_at_start"]
        print("" if at_start is None else f"; peak device memory allocated by then: {gib(at_start):.2f} GiB")
        engine.start()
        return engine, facts

    async def agreement(self, engine: Engine) -> None:
        args = self.args
        prompts = [self.prompt(args.agree_tokens * 2) for _ in range(args.agree_prompts)]
        ours = [r.token_ids for r in await generate(engine, prompts, args.agree_tokens, use_cache=False)]
        hf, logits = {}, {}
        for dtype in (self.dtype, self.reference_dtype):
            model = random_llama(args.shape, self.device, self.dtype)
            if dtype != self.dtype:
                model = model.to(dtype)  # the compute dtype's weights, widened: the same values
            model.set_attn_implementation("eager")
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor(prompts, device=self.device),
                    max_new_tokens=args.agree_tokens,
                    min_new_tokens=args.agree_tokens,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            hf[dtype] = out.sequences[:, len(prompts[0]) :].tolist()
            logits[dtype] = [step.double().cpu() for step in out.logits]  # per step: [prompts, V]
            del model, out
        reference = hf[self.reference_dtype]
        # HF's own rounding in the compute dtype, on the first token's logits (both saw the same prompt)
        noise = float((logits[self.dtype][0] - logits[self.reference_dtype][0]).abs().max())

        def agreed(a: list[int], b: list[int]) -> int:
            return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))

        def share(pairs: list[tuple[list[int], list[int]]]) -> tuple[float, float]:
            lengths = [agreed(a, b) for a, b in pairs]
            return sum(n == args.agree_tokens for n in lengths) / len(lengths), statistics.mean(lengths)

        rows = {
            "engine vs HF": share(list(zip(ours, hf[self.dtype], strict=True))),
            "engine vs reference": share(list(zip(ours, reference, strict=True))),
            "HF vs reference": share(list(zip(hf[self.dtype], reference, strict=True))),
        }
        errors = []
        for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
            at = agreed(a, b)
            if at < args.agree_tokens:
                step = logits[self.reference_dtype][at][i]
                top2 = torch.topk(step, 2).values
                gap = float(top2[0] - top2[1])
                if gap > 2 * noise:
                    errors.append(f"prompt {i}: token {at}, the reference's best two {gap:.4f} apart")
        ref_name = str(self.reference_dtype).removeprefix("torch.")
        print(
            f"greedy agreement: {args.agree_prompts} prompts of {len(prompts[0])} tokens, {args.agree_tokens} tokens "
            f"each; HF eager in {str(self.dtype).removeprefix('torch.')}, the reference HF in {ref_name} on the "
            f"same weights; HF's rounding on the first token's logits: {noise:.2e}"
        )
        print(f"  {'':22}{'identical':>10}{'tokens before a difference':>28}")
        for name, (whole, mean) in rows.items():
            print(f"  {name:22}{whole:10.0%}{mean:28.1f}")
        print(f"  differences of the engine where the reference's best two are > 2x HF's rounding apart: {len(errors)}")
        for line in errors:
            print(f"    {line}")
        if errors:
            self.failures.append(f"greedy agreement: {len(errors)} differences beyond rounding")
        self.results["agreement"] = {
            "prompts": args.agree_prompts,
            "tokens": args.agree_tokens,
            "hf_rounding": noise,
            **{name.replace(" ", "_"): {"identical": w, "mean_tokens": m} for name, (w, m) in rows.items()},
            "errors": errors,
        }

    async def prefill(self, engine: Engine, model_config: LlamaConfig, dense_params: int) -> None:
        print(f"prefill, one prompt at a time, nothing cached ({self.args.repeats} each, median):")
        print(f"  {'tokens':>7} {'TTFT ms':>9} {'tok/s':>10} {'TFLOP/s':>8}")
        rows = []
        for tokens in self.args.prefill:
            await generate(engine, [self.prompt(tokens)], 1, use_cache=False)  # this length's shapes, once
            ttfts = []
            for _ in range(self.args.repeats):
                (run,) = await generate(engine, [self.prompt(tokens)], 1, use_cache=False)
                ttfts.append(run.ttft_s)
            ttft = median_or_none(ttfts)
            rate = tokens / ttft if ttft else None
            tflops = prefill_flops(model_config, dense_params, tokens) / ttft / 1e12 if ttft else None
            print(f"  {tokens:7d} {fmt(ttft and ttft * 1000, 9)} {fmt(rate, 10)} {fmt(tflops, 8, 2)}")
            rows.append({"tokens": tokens, "ttft_s": ttft, "tok_s": rate, "tflop_s": tflops})
        self.results["prefill"] = rows

    async def decode(self, engine: Engine, batch: int) -> tuple[float | None, float | None]:
        prompts = [self.prompt(self.args.prompt_tokens) for _ in range(batch)]
        await generate(engine, prompts, 4, use_cache=False)  # this batch's shapes, once
        aggregate, per_stream = [], []
        for _ in range(self.args.repeats):
            prompts = [self.prompt(self.args.prompt_tokens) for _ in range(batch)]
            runs = await generate(engine, prompts, self.args.max_tokens, use_cache=False)
            aggregate.append(aggregate_tok_s(runs))
            per_stream.append(per_stream_tok_s(runs))
        return median_or_none(aggregate), median_or_none(per_stream)

    async def long_context(self, engine: Engine) -> tuple[float | None, float | None]:
        (run,) = await generate(engine, [self.prompt(self.args.long_tokens)], self.args.max_tokens, use_cache=False)
        return run.ttft_s, per_stream_tok_s([run])

    async def session(self, engine: Engine) -> None:
        history = self.prompt(self.args.history_tokens)
        (turn1,) = await generate(engine, [history], 1, session="check")
        follow = history + self.prompt(32)  # the next turn: the history and a new user message
        (turn2,) = await generate(engine, [follow], 1, session="check")
        (cold,) = await generate(engine, [follow], 1, use_cache=False)
        with_s, without_s = turn2.ttft_s, cold.ttft_s
        ratio = without_s / with_s if with_s and without_s else None
        print(f"turn 1 TTFT ({len(history)} tokens): {fmt(turn1.ttft_s and turn1.ttft_s * 1000, 0)} ms")
        print(
            f"turn 2 TTFT ({len(follow)} tokens): with the session {fmt(with_s and with_s * 1000, 0)} ms "
            f"({turn2.num_cached} cached), without {fmt(without_s and without_s * 1000, 0)} ms: {fmt(ratio, 0)}x"
        )
        self.results["session"] = {
            "turn2_tokens": len(follow),
            "turn2_cached": turn2.num_cached,
            "ttft_with_s": with_s,
            "ttft_without_s": without_s,
        }
        if turn2.num_cached < len(history) - engine.config.block_size:  # all but a partial block
            self.failures.append(f"turn 2 found {turn2.num_cached} of its {len(history)} history tokens cached")

    async def run(self) -> None:
        args = self.args
        config = llama_config(args.shape)
        print(f"device {self.device} ({self.device_name()}), {self.dtype}")
        on_cuda = self.device.type == "cuda"
        modes = [True, False] if on_cuda else [False]  # a CPU captures no graphs: one engine, eager
        decode: dict[tuple[int, bool], tuple[float | None, float | None]] = {}
        long: dict[bool, tuple[float | None, float | None]] = {}
        engines = {}
        for graphs in modes:
            engine, facts = self.new_engine(graphs)
            model = engine.loaded.model
            params = sum(p.numel() for p in model.parameters())
            dense_params = params - config.vocab_size * config.hidden_size  # tied: the embedding counted once
            try:
                if graphs or not on_cuda:  # the first engine: everything measured once
                    print(f"model: random Llama, {args.shape} shape, {params:,} parameters")
                    self.results["parameters"] = params
                    await self.agreement(engine)
                    await self.prefill(engine, config, dense_params)
                for batch in args.batches:
                    decode[batch, graphs] = await self.decode(engine, batch)
                    if batch == 1:
                        step_bytes = facts["weights_bytes"] + (args.prompt_tokens + args.max_tokens // 2) * (
                            engine.token_bytes
                        )
                        facts["batch1_step_bytes"] = step_bytes
                long[graphs] = await self.long_context(engine)
                if graphs or not on_cuda:
                    await self.session(engine)
            finally:
                engine.close()
                engine.stop()
            facts["peak_bytes"] = self.peak_bytes()
            peak = facts["peak_bytes"]
            print(f"  peak device memory allocated: {'n/a' if peak is None else f'{gib(peak):.2f} GiB'}")
            engines["graphs_on" if graphs else "graphs_off"] = facts
            del engine, model
        self.results["engines"] = engines
        self.report_decode(decode, long, engines)

    def report_decode(self, decode: dict, long: dict, engines: dict) -> None:
        args = self.args

        def cell(key: tuple[int, bool] | bool, table: dict) -> tuple[float | None, float | None]:
            return table.get(key, (None, None))

        print(
            f"decode, {args.prompt_tokens}-token prompts, {args.max_tokens} tokens out, greedy "
            f"({args.repeats} runs each, median); tok/s (graphs on: n/a where none were captured):"
        )
        print(f"  {'batch':>5} {'graphs on':>11} {'per stream':>11} {'graphs off':>11} {'per stream':>11}")
        rows = []
        for batch in args.batches:
            on, off = cell((batch, True), decode), cell((batch, False), decode)
            print(f"  {batch:5d} {fmt(on[0], 11)} {fmt(on[1], 11)} {fmt(off[0], 11)} {fmt(off[1], 11)}")
            rows.append({"batch": batch, "graphs": True, "tok_s": on[0], "per_stream_tok_s": on[1]})
            rows.append({"batch": batch, "graphs": False, "tok_s": off[0], "per_stream_tok_s": off[1]})
        self.results["decode"] = rows
        first = engines["graphs_on"] if "graphs_on" in engines else engines["graphs_off"]
        step_bytes = first.get("batch1_step_bytes")
        best = max((v for v in (cell((1, True), decode)[1], cell((1, False), decode)[1]) if v), default=None)
        if step_bytes and best:
            achieved = best * step_bytes / 1e9
            print(f"batch-1 decode reads {step_bytes / 1e9:.4g} GB per step: {achieved:.4g} GB/s", end="")
            if args.peak_gbps:
                roofline = args.peak_gbps * 1e9 / step_bytes
                print(f" = {achieved / args.peak_gbps:.1%} of {args.peak_gbps:.0f} GB/s", end="")
                print(f" (roofline {roofline:.0f} tok/s: {best / roofline:.1%} of it)")
            else:
                print()
        print(f"long context, {args.long_tokens}-token prompt, {args.max_tokens} tokens out:")
        print(f"  {'':12}{'TTFT ms':>9} {'decode tok/s':>13}")
        self.results["long_context"] = {"tokens": args.long_tokens}
        for graphs in (True, False):
            ttft, rate = cell(graphs, long)
            print(f"  graphs {'on ' if graphs else 'off'}  {fmt(ttft and ttft * 1000, 9)} {fmt(rate, 13)}")
            self.results["long_context"]["graphs_on" if graphs else "graphs_off"] = {"ttft_s": ttft, "tok_s": rate}

    def device_name(self) -> str:
        return torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu"


def numbers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b" if torch.cuda.is_available() else "small")
    parser.add_argument("--batches", type=numbers, default=[1, 8, 32, 64])
    parser.add_argument("--prompt-tokens", type=int, help="each decode row's prompt")
    parser.add_argument("--max-tokens", type=int, help="tokens out per decode row")
    parser.add_argument("--prefill", type=numbers, help="prompt lengths the prefill table times")
    parser.add_argument("--long-tokens", type=int, help="the long context's prompt")
    parser.add_argument("--history-tokens", type=int, help="the session's turn 1")
    parser.add_argument("--agree-prompts", type=int, help="prompts the agreement with HF continues")
    parser.add_argument("--agree-tokens", type=int, help="tokens each continues for")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=2048, help="tokens per engine step")
    parser.add_argument("--kv-gib", type=int, help="the pool's size")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, else float32")
    parser.add_argument(
        "--peak-gbps",
        type=float,
        default=4800.0 if torch.cuda.is_available() else 0.0,
        help="the device's memory bandwidth, for the fraction used (H200 HBM3e: 4800; 0: not printed)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    for name, value in DEFAULTS[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check = Check(args)
    asyncio.run(check.run())
    if args.json:
        args.json.write_text(json.dumps({"figures": check.results, "failures": check.failures}, indent=1))
    for failure in check.failures:
        print(f"FAILED: {failure}")
    sys.exit(1 if check.failures else 0)


if __name__ == "__main__":
    main()
