"""engine.cuda_graphs off CUDA: static buffers, padding and dispatch, with ``rerun_capture``
standing in for the graph (its replay reruns the forward on the same buffers into the same
output). The capture itself runs on a GPU: tests/test_gpu_engine.py."""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes, rerun_capture, uses_cuda_graphs


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
    graphs = DecodeGraphs(engine.runner, [1, 2, 4, 8], max_blocks, capture=rerun_capture)
    engine.runner.graphs = graphs
    assert _generate(engine, prompts) == eager
    if max_blocks == 3:
        assert 0 < graphs.replays < 18
        return
    assert graphs.replays == 18  # after the prefill step, one per further token of the last
    # the last replay (batch 1) left its padding rows as captured: slot -1, one-token spans
    assert (graphs.int64[2, 1:] == -1).all()
    assert graphs.lens_at == 12  # seq_lens start 16-byte aligned, after cu_query_lens
    assert graphs.int32[:12].tolist() == [*range(9), 8, 8, 8] and (graphs.int32[13:] == 1).all()


def test_graphs_only_take_plain_decode_steps(tiny_llama):
    from engine.spans import Span

    engine = LLMEngine(EngineConfig(model=tiny_llama, device="cpu", num_kv_blocks=16))
    graphs = DecodeGraphs(engine.runner, [1, 2], max_blocks=2, capture=rerun_capture)
    decode = Span([7], 20, 1, [3, 4])
    assert graphs.fits([decode]) and graphs.fits([decode, decode])
    assert not graphs.fits([])
    assert not graphs.fits([decode] * 3)  # more than the largest size
    assert not graphs.fits([Span([7, 8], 20, 1, [3, 4])])  # a prefill chunk or draft span
    assert not graphs.fits([Span([7], 20, 0, [3, 4])])  # no logits wanted
    assert not graphs.fits([Span([7], 20, 1, [3, 4, 5])])  # wider than the tables
    assert not graphs.fits([Span([7], 32, 1, [3, 4])])  # past its table: eager raises


def test_graph_batch_sizes_and_when_they_are_used():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(5) == [1, 2, 4, 5] and graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(1000)[-1] == 256
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # where CUDA is missing Triton runs in its interpreter, which a graph cannot capture
    assert uses_cuda_graphs(EngineConfig(), cuda) == torch.cuda.is_available()
    assert not uses_cuda_graphs(EngineConfig(enforce_eager=True), cuda)
    assert not uses_cuda_graphs(EngineConfig(attention_backend="torch"), cuda)
    assert not uses_cuda_graphs(EngineConfig(), cpu)
