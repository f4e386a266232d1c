"""The ``pagedspec`` command: its subcommands, and ``pagedspec bench``'s table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedspec import cli
from pagedspec.engine.entrypoints import bench


def test_usage_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("serve", "generate", "bench", "train-eagle"))
    assert cli.main([]) == 2 and "usage: pagedspec" in capsys.readouterr().err
    assert cli.main(["srve"]) == 2 and "unknown command 'srve'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "generate", "bench", "train-eagle"])
def test_each_subcommand_answers_help_as_the_installed_command(command):
    out = subprocess.run([sys.executable, "-m", "pagedspec", command, "--help"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: pagedspec {command}")


def test_bench_measures_every_batch_size(tiny_llama, tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--model", tiny_llama, "--num-kv-blocks", "64", "--batch-sizes", "1,3",
            "--input-len", "5", "--output-len", "4", "--output-json", str(path)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert [r["generated_tokens"] for r in rows] == [4, 12]
    assert all(r["generated_tok_s"] > 0 for r in rows)
    assert capsys.readouterr().out.splitlines()[0].split()[:2] == ["batch", "seconds"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--batch-sizes", "1,x"], "--batch-sizes"), (["--batch-sizes", "0"], "--batch-sizes"),
     (["--output-len", "0"], "--output-len"), (["--max-num-seqs", "0"], "max_num_seqs")],
)  # fmt: skip
def test_bench_refuses_bad_flags_before_loading_a_model(flags, message, capsys):
    assert bench.main(["--model", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err
