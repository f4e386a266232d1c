"""The user-facing API around the engine: what ``LLM.generate`` / ``LLM.chat`` accept, what an
interrupted call leaves behind, ``SamplingParams`` validation, the ``python -m pagedspec generate``
script's handling of bad input, and the model-loading modules' import graph."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

import pagedspec.engine.entrypoints.generate
import pagedspec.engine.entrypoints.llm
from pagedspec import LLM, EngineConfig, RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEXT = "one two three"


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, num_kv_blocks=64)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine.get_stats().num_free_blocks == engine.block_manager.num_blocks


# --- prompts ------------------------------------------------------------------------------------


def test_prompt_dicts_generate_like_the_plain_forms(llm):
    assert llm.get_tokenizer() is llm.tokenizer is llm.llm_engine.tokenizer is not None
    ids = llm.tokenizer.encode(TEXT)
    outs = llm.generate(
        [{"prompt": TEXT}, {"prompt_token_ids": ids}, TEXT, ids], GREEDY, use_tqdm=False
    )
    assert [o.prompt for o in outs] == [TEXT, None, TEXT, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(t) for t in token_ids(outs)}) == 1
    for single in ({"prompt": TEXT}, {"prompt_token_ids": ids}):
        assert token_ids(llm.generate(single, GREEDY, use_tqdm=False)) == token_ids(outs[:1])


def test_numpy_token_ids_are_one_prompt(llm):
    ids = llm.tokenizer.encode(TEXT)
    expected = token_ids(llm.generate(ids, GREEDY, use_tqdm=False))
    as_numpy = [np.int64(t) for t in ids]
    for prompt in (as_numpy, np.array(ids), {"prompt_token_ids": as_numpy}):
        outs = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert token_ids(outs) == expected
        assert all(type(t) is int for t in outs[0].prompt_token_ids)
    outs = llm.generate([np.array(ids), as_numpy], GREEDY, use_tqdm=False)
    assert token_ids(outs) == expected * 2


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"text": TEXT}, "'prompt'.*'prompt_token_ids'.*'text'"),
        ({}, "'prompt'.*'prompt_token_ids'"),
        ({"prompt": TEXT, "prompt_token_ids": [1, 2]}, "'prompt'.*'prompt_token_ids'"),
        ({"prompt": [1, 2]}, "prompt must be a str, got list"),
        ({"prompt_token_ids": "1 2"}, "prompt_token_ids must be a list of integer token ids"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids must be a list of integer token ids"),
        ({"prompt_token_ids": [True]}, "prompt_token_ids must be a list of integer token ids"),
        (3, "prompt must be a str, a list of token ids"),
    ],
)
def test_bad_prompts_name_the_field_and_add_nothing(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "params, match",
    [
        ({"temperature": 0}, "sampling_params must be a SamplingParams, a list of them or None, "
                             "got dict"),
        ("greedy", "sampling_params must be .*, got str"),
        ([GREEDY, {"temperature": 0}], r"sampling_params\[1\] must be a SamplingParams, got dict"),
        ([GREEDY], "sampling_params has 1 entries for 2 prompts"),
    ],
)  # fmt: skip
def test_bad_sampling_params_say_what_is_allowed(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hi", "there"], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


# --- interrupted generate -----------------------------------------------------------------------


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_generate_aborts_its_requests(tiny_llama, monkeypatch, error):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [TEXT, "The quick brown fox", "x"]
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 3:
            raise error("interrupted")
        return step()

    for _ in range(2):
        calls.clear()
        monkeypatch.setattr(engine, "step", failing_step)
        with pytest.raises(error):
            llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.setattr(engine, "step", step)
        assert_all_blocks_free(llm)
        assert not engine.has_unfinished_requests()  # idle at once, not after a step
        assert engine.get_stats().num_running == engine.get_stats().num_waiting == 0
    # The first interruption's abort outputs are drained by the second call's steps; the
    # second's are still pending: a new call returns its own outputs only, unchanged.
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert all(o.outputs[0].finish_reason == "abort" for o in engine.step())
    assert_all_blocks_free(llm)


def test_an_interrupt_inside_a_step_leaves_the_engine_idle_with_every_block_free(
    tiny_llama, monkeypatch
):
    """Ctrl-C while the model runs (mid-step, after scheduling reserved slots)."""
    llm = LLM(tiny_llama, num_kv_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = token_ids(llm.generate([TEXT, "x"], params, use_tqdm=False))
    forward, calls = engine.runner.forward, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([TEXT, "x"], params, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)
    assert token_ids(llm.generate([TEXT, "x"], params, use_tqdm=False)) == expected


def test_an_abort_before_any_step_is_idle_at_once(tiny_llama):
    engine = LLM(tiny_llama, num_kv_blocks=64).llm_engine
    engine.add_request("a", TEXT, GREEDY)
    assert engine.has_unfinished_requests()
    assert engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_free_blocks == engine.block_manager.num_blocks
    (out,) = engine.step()  # the abort's final output comes with the next step
    assert out.request_id == "a" and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.step() == []


def test_a_shut_down_engine_refuses_work(tiny_llama):
    engine = LLM(tiny_llama, num_kv_blocks=64).llm_engine
    engine.add_request("a", TEXT, GREEDY)
    engine.step()
    engine.shutdown()
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("b", TEXT, GREEDY)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()


def test_final_only_requests_report_once_cumulative_ones_every_step(tiny_llama):
    engine = LLM(tiny_llama, num_kv_blocks=64).llm_engine
    final = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                           output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    engine.add_request("final", TEXT, final)
    engine.add_request("each", TEXT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seen = {"final": [], "each": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["each"]) == 5 and [o.finished for o in seen["each"]] == [False] * 4 + [True]
    (only,) = seen["final"]
    assert only.finished and only.outputs[0].token_ids == seen["each"][-1].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="final")


# --- chat ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bos_llama(tiny_llama, tmp_path_factory) -> str:
    """The tiny model with a tokenizer that adds BOS (``<s>``, id 1) like Llama-3's and
    Mistral's; its chat template starts with ``<s>`` too."""
    path = tmp_path_factory.mktemp("bos_llama")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
    )
    tok.save_pretrained(path)
    assert AutoTokenizer.from_pretrained(path).encode("hi")[0] == tok.bos_token_id == 1
    return str(path)


def test_chat_prompt_has_exactly_one_bos(bos_llama):
    llm = LLM(bos_llama, num_kv_blocks=64)
    messages = [{"role": "user", "content": "hi"}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<s>")
    outs = llm.chat([messages, messages], GREEDY, use_tqdm=False)
    for out in outs:
        assert out.prompt == text
        assert out.prompt_token_ids.count(1) == 1 and out.prompt_token_ids[0] == 1
    assert token_ids(outs) == token_ids(llm.chat(messages, GREEDY, use_tqdm=False)) * 2


@pytest.mark.parametrize(
    "messages, field",
    [
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
         r"messages\[1\]\.role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content"),
        (["hi"], r"messages must be a non-empty list"),  # a list of conversations, then
    ],
)  # fmt: skip
def test_bad_chat_messages_name_the_field(bos_llama, messages, field):
    llm = LLM(bos_llama, num_kv_blocks=64)
    with pytest.raises(ValueError, match=field):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
    ]
    plain = [{"role": "user", "content": "hi"}]
    assert token_ids(llm.chat(parts, GREEDY, use_tqdm=False)) == token_ids(
        llm.chat(plain, GREEDY, use_tqdm=False)
    )


# --- SamplingParams -----------------------------------------------------------------------------


def test_kv_cache_dtype_names_its_allowed_values():
    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), "
        r"got 'fp8'",
    ):
        EngineConfig(kv_cache_dtype="fp8")


def test_a_16_bit_kv_cache_needs_a_float32_model(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype 'float16' needs a float32 model"):
        LLM(tiny_llama, dtype="bfloat16", kv_cache_dtype="float16", num_kv_blocks=8)


def test_a_16_bit_kv_cache_is_refused_by_xformers_before_serving(tiny_llama):
    with pytest.raises(ValueError, match="attention_backend 'xformers' cannot read"):
        LLM(tiny_llama, attention_backend="xformers", kv_cache_dtype="float16", num_kv_blocks=8)


def test_a_16_bit_kv_cache_fits_twice_the_blocks_in_the_same_memory(tiny_llama):
    def blocks(kv_cache_dtype: str) -> int:
        llm = LLM(tiny_llama, kv_cache_memory=1 << 20, kv_cache_dtype=kv_cache_dtype)
        return llm.llm_engine.block_manager.num_blocks

    assert blocks("bfloat16") == blocks("float16") == 2 * blocks("auto")


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == SamplingParams().top_k == 0


def test_unknown_sampling_param_is_a_value_error_listing_the_fields():
    with pytest.raises(ValueError, match="unknown.*'max_token'.*allowed.*'max_tokens'"):
        SamplingParams(max_token=5)


def test_sampling_params_stays_a_vllm_style_dataclass():
    params = SamplingParams(temperature=0.5, include_stop_str_in_output=True)
    assert dataclasses.is_dataclass(params) and params.include_stop_str_in_output
    assert SamplingParams().include_stop_str_in_output is False
    assert dataclasses.replace(params, top_k=-1).top_k == 0
    with pytest.raises(ValueError, match="max_token"):
        dataclasses.replace(params, max_token=3)


# --- python -m pagedspec generate
# ------------------------------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(
        pagedspec.engine.entrypoints.llm, "LLM", load
    )  # what pagedspec.engine.entrypoints.generate imports to load it


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: ")
    return err


def write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_generate_script_reports_a_missing_input_file(no_model, capsys, tmp_path):
    assert (
        pagedspec.engine.entrypoints.generate.main(["--input", str(tmp_path / "missing.txt")]) == 2
    )
    assert "--input" in (err := one_error_line(capsys)) and "missing.txt" in err


@pytest.mark.parametrize(
    "bad_line, match",
    [
        ('{"prompt": "unterminated', "invalid JSON"),
        ('["a list"]', "'prompt' or a 'messages' key"),
        ('{"text": "hi"}', "'prompt' or a 'messages' key"),
        ('{"prompt": 3}', "prompt must be a non-empty string"),
        ('{"messages": [{"role": "user"}]}', "messages must be a non-empty list"),
        ('{"prompt": "hi", "max_tokens": 5}', "unknown key(s) ['max_tokens']"),
        ('{"prompt": "hi", "messages": []}', "'prompt' or a 'messages' key"),
        ('{"prompt": "hi", "json_schema": {}, "structured_outputs": {"regex": "a"}}',
         "give one of ['json_schema', 'structured_outputs']"),
        ('{"prompt": "hi", "response_format": {"type": "yaml"}}', "response_format must be"),
        ('{"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}',
         "exactly one of"),
    ],
)  # fmt: skip
def test_generate_script_names_the_bad_input_line(no_model, capsys, tmp_path, bad_line, match):
    path = write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "fine"}', "", bad_line])
    assert pagedspec.engine.entrypoints.generate.main(["--input", path]) == 2
    err = one_error_line(capsys)
    assert "line 3" in err and match in err


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "2"], "--top-p"),
        (["--top-k", "-5"], "--top-k"),
        (["--min-p", "nan"], "--min-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--min-tokens", "20", "--max-tokens", "10"], "--min-tokens"),
        (["--request-seed", "-1"], "--request-seed"),
        (["--presence-penalty", "3"], "--presence-penalty"),
        (["--frequency-penalty", "-2.5"], "--frequency-penalty"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--block-size", "24"], "--block-size"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "0"],
         "--num-speculative-tokens"),
        (["--speculative-method", "draft"], "--draft-model"),
        (["--speculative-method", "draft", "--draft-model", "{missing}"], "--draft-model"),
        (["--dtype", "float8"], "--dtype"),
        (["--model", "{missing}"], "--model"),
        (["--output", "{missing}/out.jsonl"], "--output"),
        (["--output", "{tmp}"], "--output"),  # a directory: checked before generating
        (["--prompt", ""], "--prompt"),
    ],
)  # fmt: skip
def test_generate_script_names_the_bad_flag(no_model, capsys, tmp_path, flags, named):
    flags = [f.format(missing=tmp_path / "missing", tmp=tmp_path) for f in flags]
    assert pagedspec.engine.entrypoints.generate.main(["--prompt", "hi", *flags]) == 2
    assert one_error_line(capsys).startswith(f"error: {named}: ")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-model-len", "10000000"], "error: --max-model-len: max_model_len must be <= "),
        (["--num-kv-blocks", "1"], "error: request needs up to "),  # the prompt does not fit
        (["--tensor-parallel-size", "3"], "error: "),  # the tiny model's heads do not split 3 ways
    ],
)
def test_generate_script_reports_what_the_model_refuses_in_one_line(
    tiny_llama, capsys, flags, message
):
    prompt = "one two three " * 20
    assert (
        pagedspec.engine.entrypoints.generate.main(
            ["--model", tiny_llama, "--prompt", prompt, *flags]
        )
        == 2
    )
    assert one_error_line(capsys).startswith(message)


def test_generate_script_passes_the_kv_cache_dtype_on():
    args = pagedspec.engine.entrypoints.generate.build_parser().parse_args(
        ["--prompt", "hi", "--kv-cache-dtype", "float16"]
    )
    assert pagedspec.engine.entrypoints.generate.check_args(args)[2].kv_cache_dtype == "float16"


def test_generate_script_exits_2_without_a_traceback(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", ['{"prompt": "fine"}', "{"])
    run = subprocess.run(
        [sys.executable, "-m", "pagedspec", "generate", "--input", path],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("error: --input: ") and run.stderr.count("\n") == 1


def test_generate_script_help_shows_each_default_once(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    parser = pagedspec.engine.entrypoints.generate.build_parser()
    options = parser.format_help().split("options:", 1)[1]
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", options)]
    for action in parser._actions:
        if action.dest == "help":
            continue
        [entry] = [e for e in entries if e.split(" ")[0] == action.option_strings[0]]
        assert entry.count("default") <= 1, entry
        if action.default is not None and action.default is not False:
            assert f"(default: {action.default})" in entry, entry


def test_jsonl_prompts_round_trip(tmp_path):
    """read_prompts keeps prompts and message lists as they are."""
    messages = [{"role": "user", "content": "hi"}]
    path = write_jsonl(
        tmp_path / "in.jsonl", [json.dumps({"prompt": "a"}), json.dumps({"messages": messages})]
    )
    args = pagedspec.engine.entrypoints.generate.build_parser().parse_args(["--input", path])
    lines = pagedspec.engine.entrypoints.generate.read_prompts(args.prompt, args.input)
    assert [line.prompt for line in lines] == ["a", messages]
    assert [line.structured_outputs for line in lines] == [None, None]


def test_generate_script_takes_a_constraint_per_line(tiny_llama, capsys, tmp_path):
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"],
              "additionalProperties": False}  # fmt: skip
    lines = [
        {"prompt": "a", "json_schema": schema},
        {
            "prompt": "b",
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        },
        {"prompt": "c", "structured_outputs": {"choice": ["red", "blue"]}},
        {"prompt": "d"},
    ]
    path, out = write_jsonl(tmp_path / "in.jsonl", map(json.dumps, lines)), tmp_path / "out.jsonl"
    argv = ["--model", tiny_llama, "--input", path, "--output", str(out), "--max-tokens", "30"]
    assert (
        pagedspec.engine.entrypoints.generate.main([*argv, "--temperature", "1", "--seed", "3"])
        == 0
    )
    texts = [json.loads(r)["outputs"][0]["text"] for r in out.read_text().splitlines()]
    assert json.loads(texts[0]) in ({"k": "x"}, {"k": "y"}) and json.loads(texts[1])["k"]
    assert texts[2] in ("red", "blue")
    capsys.readouterr()
    bad_line = json.dumps({"prompt": "b", "structured_outputs": {"regex": "[0-9"}})
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "a"}', bad_line])
    assert pagedspec.engine.entrypoints.generate.main(["--model", tiny_llama, "--input", bad]) == 2
    err = one_error_line(capsys)
    assert "line 2: structured_outputs.regex:" in err


# --- import graph -------------------------------------------------------------------------------

LOADING_MODULES = (
    "pagedspec.engine.loader.gguf_loader",
    "pagedspec.engine.loader.safetensors_loader",
    "pagedspec.engine.loader.default_model",
    "pagedspec.engine.loader.model_loader",
)


@pytest.mark.parametrize("module", LOADING_MODULES)
def test_each_loading_module_imports_first_in_a_fresh_interpreter(module):
    run = subprocess.run(
        [sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def engine_imports(module: str) -> set[str]:
    """Every engine module ``module`` imports, at the top or inside a function."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("engine.")}


def test_loading_modules_import_each_other_without_a_cycle():
    graph = {m: engine_imports(m) & set(LOADING_MODULES) for m in LOADING_MODULES}
    order = []
    while graph:
        ready = [m for m, deps in graph.items() if deps <= set(order)]
        assert ready, f"import cycle among {sorted(graph)}: {graph}"
        order += ready
        for m in ready:
            del graph[m]
