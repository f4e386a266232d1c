"""Downloads into .whl/ the Python 3.12 (--python-version) manylinux wheels a bare GPU machine
needs for ``benchmarks/gpu_check.sh``: exactly the packages the check imports, and what they
require, at the versions installed here (what the tests ran with). ``make gpu-wheels`` runs it.

Left out: what the device image and the dry run's virtualenv both hold, and where a second copy
would be harmful (torch, triton and numpy: torch's C++ is built against its own numpy ABI), and
everything only the CPU side uses (matplotlib: the check writes JSON, plots are optional). The
wheels install with ``--no-deps --no-index`` there, so the closure is computed here from the
installed metadata, markers evaluated for CPython 3.12 on x86-64 Linux.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What gpu_check.sh imports: the engine and benchmarks (transformers, tokenizers, safetensors,
# gguf, tqdm), the GPU tests (pytest, the fixtures' tokenizers).
ROOTS = ("transformers", "tokenizers", "safetensors", "huggingface-hub", "gguf", "tqdm", "pytest")
EXCLUDED = {"torch", "triton", "numpy", "matplotlib"}
LIMIT_MIB = 40
_MARKERS = {"sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "extra": ""}  # fmt: skip
_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
_PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]


def closure(python_version: str, roots=ROOTS) -> dict[str, str]:
    """{name: installed version} of the roots and their runtime requirements on CPython
    ``python_version`` (e.g. "3.12"), minus EXCLUDED."""
    markers = _MARKERS | {"python_version": python_version, "python_full_version": python_version}
    pins: dict[str, str] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in pins or name in EXCLUDED:
            continue
        dist = metadata.distribution(name)
        pins[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(markers):
                todo.append(canonicalize_name(req.name))
    return pins


def download(pins: dict[str, str], dest: Path, python_version: str) -> None:
    platforms = [arg for p in _PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", *platforms,
           "-d", str(dest), *(f"{n}=={v}" for n, v in sorted(pins.items()))]  # fmt: skip
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=".whl")
    parser.add_argument("--python-version", default="3.12", help="the GPU image's: 3.12")
    args = parser.parse_args(argv)
    dest = Path(args.dest)
    pins = closure(args.python_version)
    stale = [w for w in dest.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) not in pins]
    for wheel in stale:  # one version of each package: two stop the whole install there
        wheel.unlink()
    download(pins, dest, args.python_version)
    wheels = sorted(dest.glob("*.whl"))
    names = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
    if names != set(pins) or len(wheels) != len(pins):
        raise SystemExit(f"{dest}: expected one wheel each of {sorted(pins)}, got {wheels}")
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{dest}: {len(wheels)} wheels, {mib:.1f} MiB: {', '.join(sorted(pins))}")
    if mib > LIMIT_MIB:
        raise SystemExit(f"{dest} holds {mib:.1f} MiB, over the {LIMIT_MIB} MiB budget")


if __name__ == "__main__":
    main()
