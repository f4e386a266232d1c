"""Every Triton kernel variant the engine can launch compiles for sm_80 (A100) and sm_90
(H100/H200) without spilling registers (tree-mask variants: a few bytes, TREE_STACK_LIMIT) and
within 99 KB of shared memory: compiled on the CPU by
Triton's NVIDIA backend and its bundled ptxas (pagedspec.kernels.compile_check), no GPU needed.

Slow: about 300 compiles (~3 minutes of CPU on 2 cores).
"""

import json
import os
import subprocess
import sys

import pytest

from pagedspec import kernels
from pagedspec.kernels import compile_check
from pagedspec.kernels.triton_attention import TREE_STACK_LIMIT


@pytest.mark.slow
def test_every_variant_compiles_without_spills_within_99kb():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "pagedspec.kernels.compile_check", "--archs", "80,90"],
        cwd=os.path.dirname(kernels.__path__[0]),
        env=env | {"TRITON_INTERPRET": "0"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 2 * len(compile_check.variants())
    assert {r["kernel"] for r in rows} == {"attention", "merge", "write_kv"}
    stack = {True: TREE_STACK_LIMIT, False: 0}  # bytes of spills allowed, by tree-mask variant
    bad = [
        r
        for r in rows
        if r["stack"] > stack[r.get("tree", False)] or r["shared"] > compile_check.SHARED_LIMIT
    ]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
