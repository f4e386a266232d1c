"""The ``pagedspec`` command: one subcommand per job, as ``vllm serve MODEL`` reads.

Each subcommand's module loads only once it is named, so ``pagedspec --help`` and every
subcommand's flag errors answer without importing torch.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with ``main(argv) -> int | None``, one line of help)
COMMANDS = {
    "serve": ("pagedspec.engine.serve.__main__", "serve MODEL over an OpenAI-compatible HTTP API"),
    "generate": ("pagedspec.engine.entrypoints.generate", "answer a file of prompts offline"),
    "bench": ("pagedspec.engine.entrypoints.bench", "offline throughput at a set of batch sizes"),
    "train-eagle": ("pagedspec.engine.tools.train_eagle.cli", "train an EAGLE draft head"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    return (
        "usage: pagedspec {" + ",".join(COMMANDS) + "} ...\n\n"
        f"commands:\n{rows}\n\n`pagedspec COMMAND --help` lists a command's flags."
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from pagedspec import __version__

        print(f"pagedspec {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"{usage()}\n\nerror: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    result = importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    return result if isinstance(result, int) else 0
