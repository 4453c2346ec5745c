"""Compile every Triton kernel of server/kv/triton_attention.py for an H100/H200 (sm_90) down to a cubin, on a
machine without a GPU: triton's compiler and its bundled ptxas need no device. The interpreter runs the kernels'
arithmetic; this checks what only the compiler sees (types carried through loops, tl.dot's shapes and dtypes,
fp8 and int8 conversions). Run in a process of its own (tests/kv/test_triton_attention.py): the kernels must be
defined without TRITON_INTERPRET. Prints one line per kernel variant: OK or FAIL with the error."""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from server.kv import triton_attention as ta

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(fn, pointers: dict[str, str], constexprs: dict[str, object]) -> str | None:
    """None when it compiled to a cubin, else the error."""
    scalars = {"scale": "fp32", "softcap": "fp32", "window": "i32", "block_size": "i32"}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("stride_") or name in scalars:
            signature[name] = scalars.get(name, "i32")
        else:
            signature[name] = pointers[name]
    source = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    try:
        kernel = triton.compile(source, target=TARGET)
    except Exception as exc:  # the compiler's message is the finding
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:2000]
    return None if kernel.asm.get("cubin") else "no cubin"


def variants():
    for dtype, pool in (("bf16", "bf16"), ("bf16", "i8"), ("bf16", "fp8e4nv"), ("fp32", "fp32")):
        quant = pool in ("i8", "fp8e4nv")
        p, scales, q = f"*{pool}", "*fp32" if quant else f"*{pool}", f"*{dtype}"
        kv = {"k_pool": p, "v_pool": p, "k_scales": scales, "v_scales": scales}
        largest = {"i8": 127.0, "fp8e4nv": 448.0}.get(pool, 1.0)
        store = {"D": 128, "BLOCK_D": 128, "QUANT": quant, "IS_INT8": pool == "i8", "LARGEST": largest}
        yield f"store {dtype} into {pool}", ta._store_kv_kernel, kv | {"key": q, "value": q, "slots": "*i64"}, store
        # a 16-bit pool without and with both extras, 8-bit pools with them, fp32 without
        extras_of = {"bf16": ((False, False), (True, True)), "fp32": ((False, False),)}
        for extras in extras_of.get(pool, ((True, True),)):
            softcap, window = extras
            flags = {"QUANT": quant, "SOFTCAP": softcap, "WINDOW": window, "DOT_F32": dtype == "fp32"}
            pointers = kv | {"query": q, "rows": "*i32", "tables": "*i32", "lens": "*i32"}
            pointers |= {"acc_out": "*fp32", "max_out": "*fp32", "sum_out": "*fp32"}
            shape = {"GROUP": 4, "BLOCK_G": 16, "D": 128, "BLOCK_D": 128, "BLOCK_N": ta.BLOCK_N, "SPLIT": ta.SPLIT_KEYS}
            label = f"{dtype} over {pool}, softcap {softcap}, window {window}"
            yield f"decode {label}", ta._decode_split_kernel, pointers, shape | flags
            pointers = kv | {"query": q, "out": q, "tiles": "*i32", "q_starts": "*i32", "q_lens": "*i32"}
            pointers |= {"ctx_lens": "*i32", "tables": "*i32"}
            shape = {"GROUP": 8, "D": 64, "BLOCK_D": 64, "BLOCK_M": ta.PREFILL_BLOCK_M, "BLOCK_N": ta.BLOCK_N}
            yield f"prefill {label}", ta._prefill_kernel, pointers, shape | flags
    pointers = {"out": "*bf16", "acc_in": "*fp32", "max_in": "*fp32", "sum_in": "*fp32", "rows": "*i32", "lens": "*i32"}
    yield "merge", ta._decode_merge_kernel, pointers, {"D": 128, "BLOCK_D": 128, "SPLIT": ta.SPLIT_KEYS}


def main() -> int:
    failed = 0
    for label, fn, pointers, constexprs in variants():
        error = compile_one(fn, pointers, constexprs)
        print(f"{'OK' if error is None else 'FAIL'} {label}" + ("" if error is None else f": {error}"), flush=True)
        failed += error is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
