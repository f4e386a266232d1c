"""The user-facing API around the engine: what ``LLM.generate`` / ``LLM.chat`` accept, what an
interrupted call leaves behind, ``SamplingParams`` validation, the ``python -m engine.generate``
script's handling of bad input, and the model-loading modules' import graph."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
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


# --- SamplingParams -----------------------------------------------------------------------------


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


# --- import graph -------------------------------------------------------------------------------

LOADING_MODULES = ("engine.gguf_loader", "engine.default_model", "engine.model_loader")


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
