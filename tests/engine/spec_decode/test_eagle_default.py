"""The EAGLE head shipped for the default model: greedy output with it equals greedy output
without speculation, alone and in a batch, through chunked prefill, preemption, prefix-cache
hits, n > 1 and stop strings; and it drafts well enough to be accepted."""

import pytest

from pagedspec import LLM, SamplingParams
from pagedspec.engine.models.linear import Linear
from pagedspec.engine.models.quant import quantized_weight

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits and their colors.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
N2_STOP = SamplingParams(n=2, temperature=0, max_tokens=32, stop=[" the"])
SHARED = "You are a helpful assistant. Answer briefly, clearly and without repeating yourself. "

# Speculation and its tree on in a batch too (by default eagle is off from four busy sequences
# and its leaves from two).
EAGLE = {"method": "eagle", "num_speculative_tokens": 4, "disable_batch_size": 64,
         "disable_tree_batch_size": 64}  # fmt: skip


@pytest.fixture(scope="module")
def plain():
    llm = LLM(num_kv_blocks=256)
    return {
        "alone": [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS],
        "n2-stop": llm.generate([SHARED + p for p in PROMPTS], N2_STOP, use_tqdm=False),
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_kv_blocks=256),
        dict(num_kv_blocks=256, max_num_batched_tokens=8),  # chunked prefill
        dict(num_kv_blocks=10, max_num_batched_tokens=64),  # forced preemption
    ],
    ids=["batch", "chunked", "preempt"],
)
def test_shipped_head_keeps_greedy_output(plain, kwargs):
    llm = LLM(speculative_config=EAGLE, **kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain["alone"]
    stats = llm.llm_engine.get_stats()
    assert stats.num_accepted_tokens > 0 and stats.num_free_blocks == stats.num_total_blocks
    head = llm.llm_engine.spec.proposer.head  # on the CPU in float32 it drafts on int8 weights
    assert all(
        quantized_weight(m.weight).format == "q8_0" for m in head.modules() if isinstance(m, Linear)
    )
    if kwargs["num_kv_blocks"] == 10:
        assert stats.num_preemptions > 0


@pytest.mark.slow
def test_shipped_head_with_prefix_hits_n_and_stop_strings(plain):
    llm = LLM(num_kv_blocks=256, speculative_config=EAGLE)
    params = N2_STOP
    for _ in range(2):  # the second round hits the prefix cache
        outs = llm.generate([SHARED + p for p in PROMPTS], params, use_tqdm=False)
        assert [[c.text for c in o.outputs] for o in outs] == [
            [c.text for c in o.outputs] for o in plain["n2-stop"]
        ]
    stats = llm.llm_engine.get_stats()
    assert stats.num_prefix_cache_hit_tokens > 0 and stats.num_accepted_tokens > 0
