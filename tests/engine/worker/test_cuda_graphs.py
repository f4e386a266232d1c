"""pagedspec.engine.worker.cuda_graphs and pagedspec.engine.core.graph_capture off CUDA: static
buffers, padding and dispatch, with ``rerun_capture`` standing in for the graph (its replay reruns
the forward on the same buffers into the same output). The capture itself runs on a GPU:
tests/engine/core/test_gpu_engine.py."""

import pytest
import torch
from conftest import build_random_eagle_head

from pagedspec import EngineConfig, LLMEngine, SamplingParams
from pagedspec.engine.core.graph_capture import (
    capture_graphs,
    graph_batch_sizes,
    graph_families,
    rerun_capture,
    uses_cuda_graphs,
)
from pagedspec.engine.worker.cuda_graphs import StepGraphs
from pagedspec.engine.worker.spans import Span


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


@pytest.mark.parametrize("max_blocks", [3, 4])
def test_graphed_decode_gives_the_eager_tokens(max_blocks, tiny_llama):
    gen = torch.Generator().manual_seed(0)
    # 6 requests finishing one by one: replays at padded sizes 8, 4 (4 and 3 live), 2 and 1.
    # The last one (40 prompt tokens, 19 new) needs 4 blocks of 16 from position 48 on: with
    # 3-block graph tables the steps after that run eagerly.
    prompts = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in (5, 17, 30, 9, 2, 40)]
    config = dict(model=tiny_llama, device="cpu", dtype="float32", num_kv_blocks=64)
    eager = _generate(LLMEngine(EngineConfig(**config, max_num_seqs=8)), prompts)
    engine = LLMEngine(EngineConfig(**config, max_num_seqs=8))
    graphs = StepGraphs(engine.runner, {1: [1, 2, 4, 8]}, max_blocks, capture=rerun_capture)
    engine.runner.graphs = graphs
    assert _generate(engine, prompts) == eager
    if max_blocks == 3:
        assert 0 < graphs.replays < 18
        return
    assert graphs.replays == 18  # after the prefill step, one per further token of the last
    # the last replay (batch 1) left its padding rows as captured: slot -1, one-token spans
    decode = graphs.families[1]
    assert (decode.int64[2, 1:] == -1).all()
    assert decode.lens_at == 12  # seq_lens start 16-byte aligned, after cu_query_lens
    assert decode.int32[:12].tolist() == [*range(9), 8, 8, 8] and (decode.int32[13:] == 1).all()


def test_graphs_take_decode_and_verification_steps_only(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, device="cpu", num_kv_blocks=16))
    graphs = StepGraphs(engine.runner, {1: [1, 2], 4: [1]}, max_blocks=2, capture=rerun_capture)
    decode, verify = Span([7], 20, 1, [3, 4]), Span([7, 8, 9], 20, 3, [3, 4])
    assert graphs.fits([decode]) and graphs.fits([decode, decode]) and graphs.fits([verify])
    assert graphs._family([decode]).span_len == 1 and graphs._family([verify]).span_len == 4
    # a span's padding rows may reach one block past the widest table: block 0 is there
    assert [f.block_tables.shape[1] for f in graphs.families.values()] == [2, 3]
    assert graphs.fits([Span([7, 8, 9, 10], 20, 4, [3, 4])])  # the longest span a family holds
    assert not graphs.fits([])
    assert not graphs.fits([decode] * 3)  # more than the largest size
    assert not graphs.fits([verify, decode])  # the verification family's largest batch is 1
    assert not graphs.fits([Span([7] * 5, 20, 5, [3, 4])])  # longer than every family's spans
    assert not graphs.fits([Span([7, 8], 20, 1, [3, 4])])  # a prefill chunk: rows unwanted
    assert not graphs.fits([Span([7], 20, 0, [3, 4])])  # no logits wanted
    assert not graphs.fits([Span([7], 20, 1, [3, 4, 5])])  # wider than the tables
    assert not graphs.fits([Span([7], 32, 1, [3, 4])])  # past its table: eager raises
    assert not graphs.fits([Span([7, 8, 9], 30, 3, [3, 4])])  # drafts past its table
    assert not graphs.fits([Span([7, 8, 9], 20, 3, [3, 4], [-1, 0, 0])])  # a tree: no mask
    assert not graphs.fits([decode], return_hidden=True)  # these graphs return logits only


def _generate_all(engine: LLMEngine, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def _drafts_made(engine: LLMEngine) -> list[list[list[int]]]:
    """Every step's drafts, per sequence, as the engine's proposer makes them from now on."""
    proposer, made = engine.spec.proposer, []
    propose = proposer.propose

    def recorded(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        made.append([list(d) for d in proposal.drafts])
        return proposal

    proposer.propose = recorded
    return made


@pytest.mark.parametrize("method", ["ngram", "eagle-chain", "eagle-tree"])
def test_graphed_verification_gives_the_eager_tokens(method, tiny_llama, tmp_path):
    """Verification spans (the last token, drafts and a tree's leaves) padded to the family's
    span length, with EAGLE the target's hidden states from the graph too, and the head's draft
    steps graphed: the eager tokens and drafts."""
    prompts = ["one two three four five one two three four five one two", "x y x y x y", "z"]
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    if method != "ngram":
        head = build_random_eagle_head(tmp_path / "head", tiny_llama, 300, feature_layers=(0,))
        leaves = 2 if method == "eagle-tree" else 0
        speculative = {"method": "eagle", "draft_model": head, "num_speculative_tokens": 3,
                       "draft_leaves": leaves, "disable_tree_batch_size": 1 << 20}  # fmt: skip
    speculative |= {"max_draft_skip": 0, "disable_batch_size": 1 << 20}
    config = dict(model=tiny_llama, device="cpu", dtype="float32", num_kv_blocks=64,
                  max_num_seqs=4, speculative_config=speculative)  # fmt: skip
    reference = LLMEngine(EngineConfig(**config))
    want_drafts = _drafts_made(reference)
    eager = _generate_all(reference, prompts)
    engine = LLMEngine(EngineConfig(**config))
    drafts = _drafts_made(engine)
    eagle = engine.spec.proposer if method != "ngram" else None
    capture_graphs(engine.config, engine.max_model_len, engine.runner, eagle, rerun_capture)
    span = 1 + 3 + engine.config.speculative_config.draft_leaves
    assert sorted(engine.runner.graphs.families) == [1, span]
    assert _generate_all(engine, prompts) == eager
    assert engine.runner.graphs.families[span].replays > 0
    assert engine.get_stats().num_verifications > 0
    if eagle is not None:  # its draft steps too
        assert eagle.runner.graphs.replays > 0
    # the same drafts: with EAGLE, the head read the same hidden states (a lossless verifier
    # keeps the tokens whatever the drafts)
    assert drafts == want_drafts and any(any(d) for d in drafts)


def test_graph_batch_sizes_and_when_they_are_used():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_families(256, None) == {1: graph_batch_sizes(256)}
    eagle = EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 4,
                                             "draft_model": "x"}).speculative_config  # fmt: skip
    off_from, leaves = eagle.disable_batch_size, eagle.draft_leaves
    assert graph_families(256, eagle) == {1: graph_batch_sizes(256),
                                          5 + leaves: graph_batch_sizes(off_from - 1)}  # fmt: skip
    assert graph_batch_sizes(5) == [1, 2, 4, 5] and graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(1000)[-1] == 256
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # where CUDA is missing Triton runs in its interpreter, which a graph cannot capture
    assert uses_cuda_graphs(EngineConfig(), cuda) == torch.cuda.is_available()
    assert not uses_cuda_graphs(EngineConfig(enforce_eager=True), cuda)
    assert not uses_cuda_graphs(EngineConfig(attention_backend="torch"), cuda)
    assert not uses_cuda_graphs(EngineConfig(), cpu)
