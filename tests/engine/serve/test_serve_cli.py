"""The server's command line: one flag per EngineConfig / SpeculativeConfig field, checked
before the model loads, errors naming the flag."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest
from conftest import ROOT

from pagedspec.engine.config import EngineConfig, SpeculativeConfig
from pagedspec.engine.serve.cli import build_parser, parse_args, speculative_dest


def test_every_config_field_has_a_flag():
    parser, engine, spec = build_parser()
    dests = {a.dest for a in parser._actions}
    assert set(engine) == {f.name for f in fields(EngineConfig)} - {"speculative_config"}
    assert set(spec) == {f.name for f in fields(SpeculativeConfig)}
    assert set(engine.values()) | set(spec.values()) <= dests


def test_defaults_and_flags_build_the_configs():
    args = parse_args([])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.engine == EngineConfig()
    assert args.served_model_name == "SmolLM2-135M-Instruct"
    args = parse_args(
        ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--speculative-method", "ngram",
         "--num-speculative-tokens", "3", "--speculative-ngram-max", "2", "--no-sample-drafts",
         "--kv-cache-memory", "1000000"]
    )  # fmt: skip
    assert args.engine == EngineConfig(
        max_num_seqs=8,
        enable_prefix_caching=False,
        kv_cache_memory=1_000_000,
        speculative_config=SpeculativeConfig(
            "ngram", num_speculative_tokens=3, ngram_max=2, sample_drafts=False
        ),
    )
    assert speculative_dest("method") == "speculative_method"


def test_the_model_may_come_first_as_in_vllm_serve(tmp_path):
    model = str(tmp_path)  # an existing path: the check that it exists passes
    assert parse_args([model, "--port", "9000"]).engine.model == model
    assert parse_args([model, "--model", model]).engine.model == model


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--block-size", "8"], "--block-size"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "0"],
         "--num-speculative-tokens"),
        (["--max-queue", "-1"], "--max-queue"),
        (["--max-queue", "0"], "--max-queue"),  # would answer every request 503
        (["--model", "/no/such/dir"], "--model"),
        (["/no/such/dir"], "--model"),  # the positional MODEL is --model
        (["--model", "/a", "/b"], "--model"),  # given twice, differently
    ],
)  # fmt: skip
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse_args(argv)


def test_help_reads_the_per_method_defaults_from_the_config_table():
    parser, _, spec = build_parser()
    helps = {a.dest: a.help for a in parser._actions}
    assert helps[spec["disable_batch_size"]].endswith("(default: 16, 4 for eagle)")
    assert helps[spec["max_draft_skip"]].endswith("(default: 16, 0 for eagle)")
    assert helps[spec["min_draft_confidence"]].endswith("(default: 0, 0.2 for eagle)")
    assert helps[spec["draft_leaves"]].endswith("(default: 0, 3 for eagle)")


def test_xformers_eagle_flags_verify_chains_unless_leaves_are_asked_for():
    eagle = ["--attention-backend", "xformers", "--speculative-method", "eagle"]
    assert parse_args(eagle).engine.speculative_config.draft_leaves == 0
    with pytest.raises(ValueError, match="draft_leaves needs tree masks"):
        parse_args([*eagle, "--draft-leaves", "2"])
    assert parse_args(eagle[2:]).engine.speculative_config.draft_leaves == 3


def test_help_and_flag_errors_do_not_import_torch():
    """The scripts parse and check their flags before torch and the engine load (seconds)."""
    code = (
        "import sys\n"
        "import pagedspec.engine.serve.__main__ as serve\n"
        "from pagedspec.engine.entrypoints import generate\n"
        "from pagedspec.engine.serve.cli import build_parser\n"
        "build_parser()[0].format_help(); generate.build_parser().format_help()\n"
        "assert serve.main(['--max-num-seqs', '0']) == 2\n"
        "assert generate.main(['--prompt', 'hi', '--temperature', '-1']) == 2\n"
        "print('torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
