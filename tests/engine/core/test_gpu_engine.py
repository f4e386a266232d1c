"""The engine on CUDA with the Triton kernels: the start-up warm-up compiles every variant, so
serving never compiles (and so never stalls for 1-3 s); the variant enumeration it relies on is
checked against plan_launch on the CPU.

Collected by benchmarks/gpu_check.sh on the GPU: this module imports nothing that builds the C++
CPU extension.
"""

import inspect
import itertools

import pytest
import torch

from pagedspec.kernels.triton_attention import block_m_for, plan_launch, splits_for
from pagedspec.kernels.triton_warmup import Variant, attention_variants

CUDA = torch.cuda.is_available()


def _launched(
    tokens: int, seqs: int, group: int, kv_heads: int, context: int, sms: int, limit: int
):
    """The (attention, merge) variants one launch compiles, by plan_launch's choice on a GPU."""
    cpu = torch.device("cpu")
    plan = plan_launch(tokens, seqs, group, kv_heads, context, cpu, block_m_limit=limit)
    splits = splits_for(plan.num_tiles * kv_heads, context, sms)
    attention = Variant(plan.block_m, 1 if splits == 1 else 2)
    merge = None if splits == 1 else 1 << (splits - 1).bit_length()
    return attention, merge


@pytest.mark.parametrize(
    "group, kv_heads, max_context, limit",
    [(4, 8, 8192, 64), (3, 3, 2048, 64), (32, 1, 300, 64), (4, 8, 8192, 32)],
)
def test_variants_cover_every_launch(group, kv_heads, max_context, limit):
    variants = attention_variants(group, max_context, limit)
    assert len(set(variants)) == len(variants)
    merges = {v.num_splits for v in variants if v.num_splits > 1}
    seen = set()
    sizes = (1, 2, 3, 5, 8, 16, 17, 64, 100, 256, 1000, 4096)
    for tokens, seqs, sms in itertools.product(sizes, sizes, (1, 8, 132)):
        if seqs > tokens:
            continue
        for context in (1, 256, 511, 512, 2000, max_context):
            context = min(context, max_context)
            attention, merge = _launched(tokens, seqs, group, kv_heads, context, sms, limit)
            assert attention in variants, (tokens, seqs, context, sms)
            assert merge is None or merge in merges, (tokens, seqs, context, sms)
            seen.add(attention)
            seen |= {merge} - {None}
    # Nothing compiled that no launch uses: every variant (and merge width) was seen.
    assert seen == {v for v in variants if v.num_splits <= 2} | merges


def test_block_m_covers_the_group():
    assert [block_m_for(rows, 4) for rows in (1, 16, 17, 64, 10_000)] == [16, 16, 32, 64, 64]
    assert block_m_for(1, 32) == 32
    assert attention_variants(32, 256) == [Variant(32, 1), Variant(64, 1)]


def _compiled_kernels() -> int:
    from pagedspec.kernels import triton_attention, triton_kv_write

    kernels = (
        triton_attention._attention_kernel,
        triton_attention._merge_kernel,
        triton_kv_write._write_kv_kernel,
    )
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"), [("bfloat16", "auto"), ("float32", "float16")]
)
def test_gpu_serving_compiles_nothing_after_warmup(dtype, kv_cache_dtype):
    """The warm-up compiles for the queries the model makes (float32 over a float16 cache)."""
    from pagedspec import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        model="benchmarks/model_configs/llama-3.2-1b.json", load_format="dummy",
        dtype=dtype, kv_cache_dtype=kv_cache_dtype, device="cuda", max_model_len=4096,
        max_num_seqs=64, num_kv_blocks=4096,
    )  # fmt: skip
    engine = LLMEngine(config)
    compiled = _compiled_kernels()
    assert compiled > 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    # Decodes alone (split-KV over long contexts), mixed prefill chunks, wide batches.
    for batch, prompt in ((1, 3000), (4, 1000), (64, 40), (16, 300)):
        for i in range(batch):
            ids = torch.randint(10, 1000, (prompt,), generator=gen).tolist()
            engine.add_request(f"{batch}-{i}", ids, params)
        while engine.has_unfinished_requests():
            engine.step()
    assert _compiled_kernels() == compiled, "a kernel variant was compiled while serving"


def _random_prompts(seed: int, lengths: range) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=gen).tolist() for n in lengths]


def _same_tokens_either_way(prompts: list[list[int]], option: str, check, **config) -> None:
    """Greedy tokens of an engine with ``option`` False and with it True are the same;
    ``check(engine, value)`` runs on each engine after its requests."""
    from pagedspec import EngineConfig, LLMEngine, SamplingParams

    tokens = {}
    for value in (False, True):
        engine = LLMEngine(EngineConfig(
            device="cuda", dtype="float32", num_kv_blocks=256, **config, **{option: value}
        ))  # fmt: skip
        for i, ids in enumerate(prompts):  # finishing one by one: every padded size replays
            params = SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
            engine.add_request(str(i), ids, params)
        tokens[value] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[value][out.request_id] = list(out.outputs[0].token_ids)
        check(engine, value)
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_cuda_graphs_give_the_eager_tokens(tiny_llama):
    prompts = _random_prompts(0, range(3, 60, 5))

    def check(engine, eager: bool) -> None:
        assert (engine.runner.graphs is None) == eager
        if not eager:
            assert engine.runner.graphs.replays >= 2 * len(prompts)

    _same_tokens_either_way(prompts, "enforce_eager", check, model=tiny_llama, max_num_seqs=16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_gpu_graphed_speculation_gives_the_eager_tokens(tiny_llama, tmp_path, method):
    """Verification steps (and EAGLE's draft steps, with a draft tree) replay graphs."""
    from conftest import build_random_eagle_head

    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    if method == "eagle":
        head = build_random_eagle_head(tmp_path / "head", tiny_llama, 300, feature_layers=(0,))
        speculative = {"method": "eagle", "draft_model": head, "num_speculative_tokens": 3,
                       "draft_leaves": 2}  # fmt: skip
    speculative |= {"max_draft_skip": 0, "disable_batch_size": 1 << 20}
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randint(10, 500, (6,), generator=gen).tolist()
    prompts = [pattern * n for n in (1, 2, 3, 4)]  # n-gram drafts match

    def check(engine, eager: bool) -> None:
        if not eager:
            families = engine.runner.graphs.families
            assert max(families) > 1 and families[max(families)].replays > 0
            if method == "eagle":
                assert engine.spec.proposer.runner.graphs.replays > 0

    _same_tokens_either_way(prompts, "enforce_eager", check, model=tiny_llama, max_num_seqs=4,
                            speculative_config=speculative)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_async_scheduling_gives_the_synchronous_tokens(tiny_llama):
    """Pending tokens resolved on the device, in eager steps and in the graphs' buffers."""

    def check(engine, async_scheduling: bool) -> None:
        if async_scheduling:
            assert inspect.unwrap(engine._next_step).launches > 0

    prompts = _random_prompts(1, range(3, 40, 6))
    _same_tokens_either_way(prompts, "async_scheduling", check, model=tiny_llama, max_num_seqs=8)
