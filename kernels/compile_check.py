"""Compiles every Triton kernel variant for NVIDIA targets without a GPU and reports each one's
registers, spills and shared memory: ``python -m pagedspec.kernels.compile_check --archs 80,90``.

Triton's NVIDIA backend compiles ahead of time from an ASTSource and a GPUTarget with its bundled
ptxas; cuobjdump -res-usage then reads the cubin (a STACK frame means spilled registers: the
kernels hold no local arrays). Shared memory is Triton's own figure (metadata.shared, the dynamic
allocation the launch asks for). Pointers and the strides a real launch passes are declared
16-divisible, as Triton's launcher finds them; the block-table row stride is not specialised
(do_not_specialize) and the column stride is 1.

It must import the kernels compiled, not interpreted: on a CPU-only machine run it with
TRITON_INTERPRET=0 (main() sets it when the kernels are not imported yet).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor

SHARED_LIMIT = 99 * 1024  # the smallest opt-in shared memory per block of sm_80+ GPUs (sm_86/89)
DTYPES = ("fp16", "bf16", "fp32")
HEAD_DIMS = (64, 128)  # padded head dims (BLOCK_D) of the Llama-family models served
GROUP = 4  # GQA group of the Llama 3 shapes; BLOCK_Q = BLOCK_M // GROUP
BLOCK_SIZE = 16
_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _torch_dtype(name: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def variants(dtypes=DTYPES, head_dims=HEAD_DIMS) -> list[dict]:
    """Every (kernel, constants) the engine can launch for these dtypes and head dims."""

    from pagedspec.kernels.triton_attention import _MAX_SPLITS, max_block_m
    from pagedspec.kernels.triton_warmup import attention_variants

    out = []
    for dtype, block_d in itertools.product(dtypes, head_dims):
        limit = max_block_m(_torch_dtype(dtype), block_d)
        block_ms = sorted({v.block_m for v in attention_variants(GROUP, 0, limit)})
        # the cache: the model's dtype, or 16-bit under float32 (kv_cache_dtype)
        for cache in (dtype, *(("fp16", "bf16") if dtype == "fp32" else ())):
            # tree: draft-tree verification's tree-mask variant
            for block_m, split, tree in itertools.product(block_ms, *[(False, True)] * 2):
                out.append(dict(kernel="attention", dtype=dtype, cache=cache, block_d=block_d,
                                block_m=block_m, split=split, tree=tree))  # fmt: skip
            out.append(dict(kernel="write_kv", dtype=dtype, cache=cache, block_d=block_d))
        for p2 in (2**p for p in range(1, _MAX_SPLITS.bit_length())):
            out.append(dict(kernel="merge", dtype=dtype, block_d=block_d, splits_p2=p2))
    return out


def _source(v: dict):
    """The ASTSource and launch options of variant v."""
    from triton.compiler import ASTSource

    from pagedspec.kernels import triton_attention as ta
    from pagedspec.kernels import triton_kv_write as tw

    dtype = v["dtype"]
    if v["kernel"] == "attention":
        kernel = ta._attention_kernel
        ptrs = {n: f"*{dtype}" for n in ("q_ptr", "out_ptr")}
        ptrs |= {n: f"*{v['cache']}" for n in ("k_ptr", "v_ptr")}
        ptrs |= {n: "*fp32" for n in ("part_m_ptr", "part_l_ptr", "part_acc_ptr")}
        ptrs |= {n: "*i32" for n in ("block_tables_ptr", "cu_query_lens_ptr", "seq_lens_ptr")}
        ptrs["tree_mask_ptr"] = "*i64" if v["tree"] else "*i32"  # unread without TREE
        config = ta.kernel_config(
            _torch_dtype(dtype), v["block_d"], v["block_m"], _torch_dtype(v["cache"])
        )
        consts = dict(GROUP=GROUP, BLOCK_M=v["block_m"], BLOCK_Q=v["block_m"] // GROUP,
                      BLOCK_N=config.block_n, BLOCK_D=v["block_d"], BLOCK_SIZE=BLOCK_SIZE,
                      SPLIT_KV=v["split"], DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                      TREE=v["tree"], stride_bt_m=1)  # fmt: skip
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    elif v["kernel"] == "merge":
        kernel = ta._merge_kernel
        ptrs = {"out_ptr": f"*{dtype}"} | {n: "*fp32" for n in ("part_m_ptr", "part_l_ptr")}
        ptrs["part_acc_ptr"] = "*fp32"
        consts = dict(SPLITS_P2=v["splits_p2"], BLOCK_D=v["block_d"])
        options = {}
    else:
        kernel = tw._write_kv_kernel
        ptrs = {n: f"*{dtype}" for n in ("key_ptr", "value_ptr")}
        ptrs |= {n: f"*{v['cache']}" for n in ("k_cache_ptr", "v_cache_ptr")}
        ptrs["slot_ptr"] = "*i64"
        consts = dict(BLOCK_SIZE=BLOCK_SIZE, BLOCK_H=8, BLOCK_D=v["block_d"])
        options = {}
    unspecialised = {p.name for p in kernel.params if p.do_not_specialize}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = ptrs.get(name, "fp32" if name == "scale" else "i32")
        aligned = name in ptrs or name == "head_dim"
        aligned |= name.startswith("stride") and name not in unspecialised
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, consts, attrs), options


def compile_variant(job: tuple[dict, int]) -> dict:
    """Compiles variant v for sm_{arch}; v with reg, stack (spill) bytes and shared bytes added."""
    import triton
    from triton.backends.compiler import GPUTarget

    v, arch = job
    src, options = _source(v)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-res-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    reg, stack, _, local = map(int, _RES.search(usage).groups())
    return v | dict(arch=arch, reg=reg, stack=stack + local, shared=compiled.metadata.shared)


def compile_all(archs: list[int], jobs: int | None = None) -> list[dict]:
    """Every variant compiled for every arch, in parallel processes."""
    work = list(itertools.product(variants(), archs))
    with ProcessPoolExecutor(jobs or os.cpu_count()) as pool:
        return list(pool.map(compile_variant, work))


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "0")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="80,90", help="compute capabilities, e.g. 80,90")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles (CPU count)")
    args = parser.parse_args(argv)
    for row in compile_all([int(a) for a in args.archs.split(",")], args.jobs):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
