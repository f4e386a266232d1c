"""The C++ CPU kernels (kernels/csrc): paged attention and the KV-cache write, the packed GEMM of
Linear (with SwiGLU fused in), and fused decoder-layer ops.

Compiled with torch.utils.cpp_extension (g++ and ninja) into torch's extension cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) the first time a process needs them, about
a minute once per machine (``make setup`` does it); later processes load the cached build. The
build's name carries a hash of the sources, the flags, Python and torch (its version and where it
is installed: the compile commands name its headers, and ninja rebuilds everything when a
command changes), so two checkouts share a build when these agree and two virtualenvs never
rebuild over each other's. The build compiles a copy of the sources kept in its own folder
(``stage_sources``): compiled from each checkout's own path, two checkouts of the same sources
changed the commands and rebuilt the shared build in turn.
The build targets the SIMD level torch itself dispatches to on this CPU (ATen's
Vectorized<float>: AVX512 or AVX2). Its OpenMP regions run in torch's own OpenMP runtime where
the dynamic loader shares it (torch's Linux wheels bundle libgomp.so.1 under the system soname),
so torch.set_num_threads applies to the kernels too.
"""

import fcntl
import functools
import hashlib
import logging
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (
    "bindings.cpp",
    "cpu_paged_attention.cpp",
    "cpu_layer_ops.cpp",
    "cpu_linear.cpp",
    "cpu_linear_q8.cpp",
    "cpu_linear_q4.cpp",
    "cpu_linear_bf16.cpp",
    "cpu_layer_stack.cpp",
)
# torch.backends.cpu.get_cpu_capability() -> the flags that select ATen's matching Vectorized.
_SIMD_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def load() -> ModuleType:
    """The compiled extension (built on first call; raises if it cannot be built)."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    simd = capability if capability in _SIMD_FLAGS else "DEFAULT"
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={simd}", f"-DCPU_CAPABILITY_{simd}"]
    flags += _SIMD_FLAGS.get(simd, [])
    if simd == "AVX512" and "avx512_vnni" in _cpu_flags():
        flags.append("-mavx512vnni")  # the int8/Q4_1 kernels' vpdpwssd (cpu_int_dot.h)
    name = build_name(simd, flags, _CSRC)
    build_dir = Path(cpp_extension.get_default_build_root()) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # One process at a time loads (and if need be builds) this build, under a flock that the
    # kernel releases when its holder dies. torch's own ``lock`` file is released only in a
    # ``finally``: a build killed by a signal leaves it, and every later load would wait on it
    # forever. Holding the flock, no live load of ours is building here, so a ``lock`` is stale.
    with open(build_dir / "pagedspec.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=name,
            build_directory=str(build_dir),
            sources=stage_sources(_CSRC, build_dir, _SOURCES),
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
        )


def stage_sources(csrc: Path, build_dir: Path, sources: tuple[str, ...]) -> list[str]:
    """The paths of ``sources`` in ``build_dir``/src, a copy of every file in ``csrc`` (headers
    too) that is rewritten only where its bytes differ (a copy cut short), so that its
    modification times, which ninja compares, stay those of the first copy."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for path in csrc.iterdir():
        copy = staged / path.name
        if path.is_file() and (not copy.is_file() or copy.read_bytes() != path.read_bytes()):
            partial = copy.with_name(copy.name + ".partial")
            shutil.copyfile(path, partial)
            partial.replace(copy)  # atomic: a reader never sees half a file
    return [str(staged / source) for source in sources]


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere). The extension is built
    on the machine that runs it, and the flags are part of its build name."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_name(simd: str, flags: list[str], csrc: Path) -> str:
    """``pagedspec_cpu_<simd>_<hash>``: the hash covers every file in ``csrc`` (sources and
    headers), the compiler flags, the Python version, torch's version and its install folder."""
    digest = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    torch_dir = str(Path(torch.__file__).parent)
    digest.update(" ".join([*flags, sys.version, torch.__version__, torch_dir]).encode())
    return f"pagedspec_cpu_{simd.lower()}_{digest.hexdigest()[:16]}"


@functools.cache
def available() -> bool:
    """Whether the extension is built or can be built here; warns once when it cannot."""
    try:
        load()
    except Exception as error:  # a missing compiler or ninja surfaces as many exception types
        logger.warning("C++ CPU kernels unavailable, falling back to PyTorch ops: %s", error)
        return False
    return True
