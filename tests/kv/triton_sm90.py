"""Compile the Triton kernels of server/kv/triton_attention.py for an H100/H200 (sm_90) down to a cubin, on a machine
without a GPU: triton's compiler and its bundled ptxas need no device. The interpreter runs the kernels' arithmetic;
this checks what only the compiler sees (types carried through loops, tl.dot's shapes and dtypes, fp8 and int8
conversions). Run in a process of its own (tests/kv/test_triton_attention.py): the kernels must be defined without
TRITON_INTERPRET.

What it compiles is what the launchers pass: each variant's constexprs come from the function its launcher calls
(`ta.decode_config` and the others) for the shapes a device session runs, so a GQA group is padded here exactly as
`decode()` pads it. The variants compile in as many processes as there are cores. Prints one line per variant, in
order: OK or FAIL with the error."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

if __name__ == "__main__":  # the kernels are compiled, so defined without the interpreter (a test imports the list)
    os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from server.kv import triton_attention as ta

TARGET = GPUTarget("cuda", 90, 32)
# The models a device session runs (bench/gpu_check.sh): bench/gpu_check.py's Llama-3.2-1B shape in bf16 (32 query
# heads over 8 kv heads, head size 64) and tests/engine/test_cuda.py's tiny Llama in fp32 (4 over 2, head size 16).
DEVICE_SHAPES = {"1b": (torch.bfloat16, 32, 8, 64), "tiny": (torch.float32, 4, 2, 16)}
# Each compute dtype's pools (None: the compute dtype), each with the layer extras it is compiled for, as
# (windowed, softcapped): a 16-bit pool without and with both, an 8-bit pool with both, fp32 without.
POOLS: dict[torch.dtype, tuple[tuple[torch.dtype | None, tuple[tuple[bool, bool], ...]], ...]] = {
    torch.bfloat16: (
        (None, ((False, False), (True, True))),
        (torch.int8, ((True, True),)),
        (torch.float8_e4m3fn, ((True, True),)),
    ),
    torch.float32: ((None, ((False, False),)),),
}
TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}
SCALARS = {"scale": "fp32", "softcap": "fp32", "window": "i32", "block_size": "i32"}

Variant = tuple[str, Any, dict[str, str], dict[str, Any]]  # label, kernel, pointer types, constexprs


def variants() -> Iterator[Variant]:
    """Every kernel as its launcher would launch it for each device shape, pool and extras."""
    for shape, (dtype, num_heads, kv_heads, dim) in DEVICE_SHAPES.items():
        q = f"*{TYPES[dtype]}"
        for kv_dtype, extras in POOLS[dtype]:
            quant = kv_dtype is not None
            pool = f"*{TYPES[kv_dtype or dtype]}"
            scales = "*fp32" if quant else pool
            kv = {"k_pool": pool, "v_pool": pool, "k_scales": scales, "v_scales": scales}
            store = ta.store_config(dim, kv_dtype or dtype, quant)
            pointers = kv | {"key": q, "value": q, "slots": "*i64"}
            yield f"{shape}: store {q[1:]} into {pool[1:]}", ta._store_kv_kernel, pointers, store
            for windowed, softcapped in extras:
                label = f"{shape}: {q[1:]} over {pool[1:]}, window {windowed}, softcap {softcapped}"
                pointers = kv | {"query": q, "rows": "*i32", "tables": "*i32", "lens": "*i32"}
                pointers |= {"acc_out": "*fp32", "max_out": "*fp32", "sum_out": "*fp32"}
                config = ta.decode_config(num_heads, kv_heads, dim, dtype, quant, windowed, softcapped)
                yield f"decode {label}", ta._decode_split_kernel, pointers, config
                pointers = kv | {"query": q, "out": q, "tiles": "*i32", "q_starts": "*i32", "q_lens": "*i32"}
                pointers |= {"ctx_lens": "*i32", "tables": "*i32"}
                config = ta.prefill_config(num_heads, kv_heads, dim, dtype, quant, windowed, softcapped)
                yield f"prefill {label}", ta._prefill_kernel, pointers, config
        pointers = {"out": q, "acc_in": "*fp32", "max_in": "*fp32", "sum_in": "*fp32", "rows": "*i32", "lens": "*i32"}
        yield f"{shape}: merge into {q[1:]}", ta._decode_merge_kernel, pointers, ta.merge_config(dim)


def signature(fn: Any, pointers: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Each argument's type as triton's launcher names it: "*bf16" (a pointer), "i32", "fp32" or "constexpr"."""
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name.startswith("stride_") or name in SCALARS:
            types[name] = SCALARS.get(name, "i32")
        else:
            types[name] = pointers[name]
    return types


def compile_one(fn: Any, pointers: dict[str, str], constexprs: dict[str, Any]) -> str | None:
    """None when it compiled to a cubin, else the error."""
    types = signature(fn, pointers, constexprs)
    source = ASTSource(fn, types, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    try:
        kernel = triton.compile(source, target=TARGET)
    except Exception as exc:  # the compiler's message is the finding
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:2000]
    return None if kernel.asm.get("cubin") else "no cubin"


def compile_at(index: int) -> str | None:
    """In a worker: the index-th variant (listed again there: kernels do not travel between processes)."""
    _, fn, pointers, constexprs = list(variants())[index]
    return compile_one(fn, pointers, constexprs)


def main() -> int:
    todo = list(variants())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(len(todo), cores)
    # fork: a worker starts with this process's kernels defined (no second import, no TRITON_INTERPRET)
    failed = 0
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        for (label, *_), error in zip(todo, pool.map(compile_at, range(len(todo))), strict=True):  # in order
            print(f"{'OK' if error is None else 'FAIL'} {label}" + ("" if error is None else f": {error}"), flush=True)
            failed += error is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
