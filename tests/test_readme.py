"""README.md stays a user's page whose commands run as written, and the docs' links hold.

Every command in README.md's shell blocks (```bash, ```sh, ```shell, ```console) and every
inline `pagedspec ...`, `python -m ...` or `make ...` span is checked without loading a model:

- a `--help` line runs as written (``sys.executable -m pagedspec`` for ``pagedspec``) and must
  exit 0;
- any other line of a subcommand (``pagedspec SUB``, ``python -m pagedspec SUB``, or
  ``python -m pagedspec.serve``) is parsed by that subcommand's parser (``PARSERS``): its flags
  must exist and take the values shown (an inline span that only names a command is not one);
- any other module must exist, and a make target must be one the Makefile defines;
- a command of any other program fails until a check is added for it.

docs/*.md are held to their `python -m` modules existing; every relative link in README.md and
docs/*.md must point at a file in the repository (and at a heading, for a `#anchor`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 230

SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"`((?:python3? -m|make|pagedspec) [^`]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _generate_parser():
    from pagedspec.engine.entrypoints.generate import build_parser

    return build_parser()


def _serve_parser():
    from pagedspec.engine.serve.cli import build_parser

    return build_parser()[0]


def _train_eagle_parser():
    from pagedspec.engine.tools.train_eagle.cli import build_parser

    return build_parser()


# Subcommands whose command lines are parsed (flags only: no model, path or input file is read).
PARSERS: dict[str, Callable] = {
    "generate": _generate_parser,
    "serve": _serve_parser,
    "train-eagle": _train_eagle_parser,
}
# `python -m MODULE` spellings of a subcommand
MODULE_COMMANDS = {"pagedspec.serve": "serve"}


def _fenced(text: str) -> list[tuple[str, str]]:
    return [(lang.strip().lower(), body) for lang, body in FENCE.findall(text)]


def _shell_lines(text: str) -> Iterator[str]:
    for lang, body in _fenced(text):
        if lang in SHELL_LANGS:
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if line and not line.startswith("#"):
                    yield line


def _inline_lines(text: str) -> Iterator[str]:
    yield from INLINE.findall(FENCE.sub("", text))


def _normalized(lines: Iterator[str]) -> list[str]:
    """Each command once, comments and runs of spaces dropped."""
    return list(dict.fromkeys(shlex.join(shlex.split(line, comments=True)) for line in lines))


def _commands(text: str) -> list[str]:
    return _normalized(iter([*_shell_lines(text), *_inline_lines(text)]))


def _is_name(line: str) -> bool:
    """An inline `pagedspec SUB` with nothing after it names the command, as prose does
    ("`pagedspec generate` answers a batch of prompts"); it is not a command line."""
    return line in INLINE_NAMES


def _split(line: str) -> tuple[dict[str, str], list[str]]:
    """Leading VAR=value assignments, and the words of the command after them."""
    words = shlex.split(line, comments=True)
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def _module_exists(module: str) -> bool:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", makefile, re.M))


def _subcommand(words: list[str]) -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) of `pagedspec SUB ...`, `python -m pagedspec SUB ...` or
    `python -m pagedspec.serve ...`; None for any other command."""
    if words[:1] == ["pagedspec"] and len(words) > 1:
        return words[1], words[2:]
    if words[:1] in (["python"], ["python3"]) and words[1:2] == ["-m"] and len(words) > 2:
        if words[2] == "pagedspec" and len(words) > 3:
            return words[3], words[4:]
        if words[2] in MODULE_COMMANDS:
            return MODULE_COMMANDS[words[2]], words[3:]
    return None


def _parse(command: str, args: list[str]) -> None:
    parser = PARSERS[command]()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"pagedspec {command} {shlex.join(args)}: exit {exc.code}\n{err.getvalue()}")


README_TEXT = README.read_text()
README_COMMANDS = _commands(README_TEXT)
INLINE_NAMES = {
    line
    for line in _normalized(_inline_lines(README_TEXT))
    if line not in _normalized(_shell_lines(README_TEXT))
    and len(shlex.split(line)) == (2 if line.startswith("pagedspec ") else 3)
}


def test_readme_shows_commands():
    """The extraction found what it should: the --help lines run below are not vacuous."""
    helps = [c for c in README_COMMANDS if "--help" in shlex.split(c)]
    assert "pagedspec serve --help" in helps and "pagedspec generate --help" in helps
    assert any(c.startswith("make ") for c in README_COMMANDS)


@pytest.mark.parametrize("line", README_COMMANDS, ids=README_COMMANDS)
def test_readme_command_runs_as_written(line):
    env, words = _split(line)
    assert words, line
    program, args = words[0], words[1:]
    if program == "make":
        missing = [t for t in args if not t.startswith("-") and t not in _make_targets()]
        assert not missing, f"{line!r}: no Makefile target {missing}"
        return
    sub = _subcommand(words)
    if sub is not None:
        command, module_args = sub
        assert command in PARSERS or command == "bench", f"{line!r}: no command {command!r}"
        argv = ["-m", "pagedspec", command, *module_args]
    elif program in ("python", "python3") and args[:1] == ["-m"] and len(args) >= 2:
        command, module_args = None, args[2:]
        assert _module_exists(args[1]), f"{line!r}: no module {args[1]}"
        argv = args
    else:
        pytest.fail(f"{line!r}: README shows a command this test cannot check; add a check")
    if "--help" in module_args or "-h" in module_args:
        # argparse prints help as soon as it meets --help, before it would refuse an unknown
        # flag: the flags around it are parsed on their own below
        proc = subprocess.run(
            [sys.executable, *argv],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"{line!r}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        assert "usage" in proc.stdout.lower(), f"{line!r} printed no usage"
        module_args = [a for a in module_args if a not in ("--help", "-h")]
        if not module_args:
            return
    if command in PARSERS and not _is_name(line):
        _parse(command, module_args)


def test_readme_python_blocks_compile_and_import_public_names():
    import pagedspec

    blocks = [body for lang, body in _fenced(README_TEXT) if lang == "python"]
    assert blocks
    for body in blocks:
        tree = ast.parse(body)  # a SyntaxError names the line
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "pagedspec":
                names = {alias.name for alias in node.names}
                assert names <= set(pagedspec.__all__), names - set(pagedspec.__all__)


def test_readme_length():
    lines = len(README_TEXT.splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail into docs/"
    )


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(page):
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        exists = resolved.exists() and resolved.is_relative_to(ROOT)
        if not exists or anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_python_modules_exist(page):
    text = page.read_text()
    missing = []
    for line in _commands(text):
        _, words = _split(line)
        is_module = words[:2] in (["python", "-m"], ["python3", "-m"]) and len(words) > 2
        if is_module and not _module_exists(words[2]):
            missing.append(words[2])
    assert not missing, f"{page.relative_to(ROOT)}: no module {missing}"


ARCHITECTURE = ROOT / "docs" / "architecture.md"
READING_ROW = re.compile(r"^\| \d+ \| `([^`]+)` \| (\d+) \|", re.M)


def test_the_reading_path_counts_the_lines_its_files_have():
    """docs/architecture.md's reading path names files that exist, with their line counts,
    and its totals are the sums of its tables (the "afternoon" promise stays measured)."""
    text = ARCHITECTURE.read_text()
    rows = READING_ROW.findall(text)
    assert len(rows) > 20
    wrong = {path: int(n) for path, n in rows
             if len((ROOT / path).read_text().splitlines()) != int(n)}  # fmt: skip
    assert not wrong, f"stale line counts in docs/architecture.md: {wrong}"
    tables = text.split("Speculation adds these")
    plain = sum(int(n) for _, n in READING_ROW.findall(tables[0]))
    spec = sum(int(n) for _, n in READING_ROW.findall(tables[1]))
    assert f"That is {plain:,} lines" in text and f"({spec:,} more.)" in text


def test_the_documented_layers_are_the_import_contracts():
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in contracts["contracts"] if c.get("containers") == ["pagedspec.engine"])
    section = ARCHITECTURE.read_text().split("## Layers")[1].split("## ")[0]
    documented = re.findall(r"^\d+\. (.+?)(?: — .*)?$", section, re.M)
    as_contract = [" | ".join(re.findall(r"`(\w+)`", line)) for line in documented]
    assert as_contract == layers["layers"]
