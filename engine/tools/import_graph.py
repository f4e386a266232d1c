"""Counts what the import contract forbids, for a tree with or without the contract: import
circles (groups of modules that import each other round, TYPE_CHECKING imports included) and
imports from a lower engine room to a higher one (the rooms of pyproject.toml's layers
contract over ``pagedspec.engine``).

    python -m pagedspec.engine.tools.import_graph               # this checkout
    python -m pagedspec.engine.tools.import_graph --tree DIR --renames 8677fe1..8ad52a3

``--tree DIR``: another checkout (e.g. a ``git worktree`` of an older commit), read as the
packages at its top (``engine``, ``kernels``, ...) or under ``pagedspec``. ``--renames A..B``:
its modules are named as the commits' renames (``git diff -M30% A B``) place them, so an older
tree's modules fall into today's rooms. Needs grimp (installed with import-linter) and
Python 3.11 (tomllib).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]  # the checkout (engine/tools/this file)


def room_ranks(pyproject: Path) -> dict[str, int]:
    """Each engine room (a module under pagedspec.engine) -> its layer, 0 the highest."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c.get("containers") == ["pagedspec.engine"])["layers"]
    return {
        f"pagedspec.engine.{room.strip()}": rank
        for rank, layer in enumerate(layers)
        for room in layer.split("|")
    }


def renames(commits: str, tree: Path) -> dict[str, str]:
    """Old module -> new module, from the renames git finds between the two commits."""
    old, new = commits.split("..")
    out = subprocess.run(["git", "diff", "-M30%", "--name-status", old, new], cwd=tree,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    moves = {}
    for line in out.splitlines():
        status, *paths = line.split("\t")
        if status.startswith("R") and paths[0].endswith(".py"):
            moves[_module(paths[0])] = "pagedspec." + _module(paths[1])
    return moves


def _module(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def count(tree: Path, moves: dict[str, str], ranks: dict[str, int]) -> tuple[int, int]:
    """(import circles, lower-to-higher imports) of the tree's packages."""
    import grimp

    roots = ["pagedspec"] if (tree / "pagedspec" / "__init__.py").is_file() else [
        p for p in ("engine", "kernels", "scheduler", "memory") if (tree / p).is_dir()]  # fmt: skip
    sys.path.insert(0, str(tree))
    graph = grimp.build_graph(*roots, cache_dir=None)

    def name(module: str) -> str:
        if module in moves:
            return moves[module]
        return module if module.startswith("pagedspec") else f"pagedspec.{module}"

    edges = {
        (name(a), name(b))
        for a in graph.modules
        for b in graph.find_modules_directly_imported_by(a)
    }
    upward = sum(_rank(a, ranks) > _rank(b, ranks) >= 0 for a, b in edges)
    return len(_circles(edges)), upward


def _rank(module: str, ranks: dict[str, int]) -> int:
    """The layer of the module's room; -1 outside the engine's rooms."""
    return ranks.get(".".join(module.split(".")[:3]), -1)


def _circles(edges: set[tuple[str, str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in succ:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = counter[0] = counter[0] + 1
        stack.append(start), on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = set()
                    while (w := stack.pop()) != v:
                        on.discard(w), group.add(w)
                    on.discard(v), group.add(v)
                    if len(group) > 1:
                        found.append(group)
            elif w not in index:
                index[w] = low[w] = counter[0] = counter[0] + 1
                stack.append(w), on.add(w)
                work.append((w, iter(succ[w])))
            elif w in on:
                low[v] = min(low[v], index[w])
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedspec.engine.tools.import_graph")
    p.add_argument("--tree", type=Path, default=ROOT, help="the checkout to read")
    p.add_argument("--renames", help="A..B: name the tree's modules as these commits move them")
    args = p.parse_args(argv)
    moves = renames(args.renames, ROOT) if args.renames else {}
    os.chdir(args.tree)
    circles, upward = count(args.tree.resolve(), moves, room_ranks(ROOT / "pyproject.toml"))
    print(f"{args.tree}: {circles} import circles, {upward} lower-to-higher imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
