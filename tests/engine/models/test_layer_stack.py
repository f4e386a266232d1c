"""The one-call C++ decoder stack (pagedspec.engine.models.layer_stack) against the Python layer
loop it replaces: the same kernels on the same arguments, so the same bits (torch.equal, not a
tolerance), and the Python loop wherever the stack would compute anything else."""

import pytest
import torch
from paged_harness import PagedHarness
from test_models import COMMON, SCHEDULE, run_schedule, save_tiny
from transformers import LlamaConfig, Qwen3Config

from pagedspec import LLM, SamplingParams
from pagedspec.engine.distributed.shard import TPShard
from pagedspec.engine.loader.model_loader import load_model
from pagedspec.engine.models.layer_stack import LayerStack
from pagedspec.engine.models.llama import LlamaModel
from pagedspec.kernels import cpu_extension

pytestmark = pytest.mark.skipif(
    not cpu_extension.available(), reason="the C++ CPU kernels cannot be built here"
)

PRECISIONS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "q4_1": dict(dtype="float32", quantization="q4_1"),
}
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON | dict(num_hidden_layers=3)),
    # biases on q/k/v, o_proj and the MLP; a tied head (the embedding reads its pack)
    "bias-tied": lambda: LlamaConfig(
        **COMMON | dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    ),
    # I = 72 is no multiple of 16: gate_up's product, then silu_and_mul (AVX512 builds)
    "unfused-mlp": lambda: LlamaConfig(**COMMON | dict(intermediate_size=72)),
    # q/k RMSNorm per head before rope, head_dim 32 != hidden / heads
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),
}


@pytest.fixture
def stack_calls(monkeypatch) -> list[bool]:
    """Whether each LayerStack.run ran the stack (True) or left it to the Python loop."""
    calls: list[bool] = []
    run = LayerStack.run

    def spy(self, *args):
        out = run(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(LayerStack, "run", spy)
    return calls


def load(path, precision: str) -> torch.nn.Module:
    return load_model(str(path), device="cpu", **PRECISIONS[precision]).model


def python_loop(model: torch.nn.Module) -> torch.nn.Module:
    model.model.layer_stack = None
    return model


def assert_same_bits(got: dict, want: dict) -> None:
    for seq, (_, logits) in want.items():
        assert torch.equal(got[seq][1], logits), f"sequence {seq}"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_stack_gives_the_python_loops_bits(precision, config, tmp_path, stack_calls):
    """Prefill chunks, decodes and late arrivals mixed in one batch."""
    save_tiny(CONFIGS[config](), tmp_path)
    fast = run_schedule(load(tmp_path, precision), SCHEDULE, backend="cpu")
    assert stack_calls and all(stack_calls)
    stack_calls.clear()
    reference = python_loop(load(tmp_path, precision))
    assert_same_bits(run_schedule(reference, SCHEDULE, backend="cpu"), fast)
    assert not stack_calls


def test_python_loop_runs_where_the_stack_would_differ(tmp_path, stack_calls):
    """The torch attention backend and grad mode take the Python loop."""
    save_tiny(LlamaConfig(**COMMON), tmp_path)
    model = load(tmp_path, "fp32")
    run_schedule(model, SCHEDULE[:2], backend="torch")
    assert stack_calls == [False, False]
    stack_calls.clear()
    with torch.enable_grad():  # (PagedHarness runs under inference_mode: call the model here)
        h = model.model.embed_tokens(torch.tensor([1, 2]))
        cos, sin = model.model.rotary_emb(torch.tensor([0, 1]), h.dtype)
        assert model.model.layer_stack.run(model.model.layers, h, cos, sin, [], None) is None


def test_tensor_parallel_model_has_no_stack():
    with torch.device("meta"):
        sharded = LlamaModel(LlamaConfig(**COMMON), TPShard(rank=0, size=2))
        single = LlamaModel(LlamaConfig(**COMMON))
    assert sharded.layer_stack is None and single.layer_stack is not None


def test_a_stale_pack_rebuilds_the_stack(tmp_path, stack_calls):
    """A weight given new values (unpacked, changed) takes the Python loop until it is packed
    again; then a rebuilt stack runs on the new pack. Never the old pack's numbers."""
    save_tiny(LlamaConfig(**COMMON), tmp_path)
    model, reference = load(tmp_path, "fp32"), python_loop(load(tmp_path, "fp32"))
    run_schedule(model, SCHEDULE[:1], backend="cpu")
    for m in (model, reference):
        down = m.model.layers[1].mlp.down_proj
        down.unpack()
        with torch.no_grad():
            down.weight.mul_(-2.0)
    stack_calls.clear()
    assert_same_bits(run_schedule(model, SCHEDULE[:2], backend="cpu"),
                     run_schedule(reference, SCHEDULE[:2], backend="cpu"))  # fmt: skip
    assert stack_calls == [False, False]
    for m in (model, reference):
        m.model.layers[1].mlp.down_proj.prepack()
    stack_calls.clear()
    assert_same_bits(run_schedule(model, SCHEDULE[:2], backend="cpu"),
                     run_schedule(reference, SCHEDULE[:2], backend="cpu"))  # fmt: skip
    assert stack_calls == [True, True]


@pytest.mark.parametrize("stack", [True, False])
def test_missing_kv_caches_are_a_value_error(stack, tmp_path):
    save_tiny(LlamaConfig(**COMMON), tmp_path)
    model = load(tmp_path, "fp32")
    harness = PagedHarness(model if stack else python_loop(model), 1, 8, backend="cpu")
    harness.kv_caches.pop()
    with pytest.raises(ValueError, match="kv_caches must hold 2|shorter"):
        harness.step([(0, [1, 2, 3])])


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_engine_greedy_is_the_same_with_the_stack_on_and_off(precision, tiny_llama, stack_calls):
    """Several sequences, chunked prefill (9 tokens a step) and prefix-cache hits (a shared
    prefix, and the batch generated twice): the same tokens either way."""
    prefix = "The quick brown fox jumps over the lazy dog. " * 2
    prompts = [prefix + end for end in ("one two", "three four five", "six")] + ["abc abc"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def generate(stack: bool) -> list[list[int]]:
        llm = LLM(tiny_llama, num_kv_blocks=128, max_num_batched_tokens=9, **PRECISIONS[precision])
        if not stack:
            python_loop(llm.llm_engine.runner.model)
        outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
        assert llm.llm_engine.get_stats().num_prefix_cache_hit_tokens > 0
        return [o.outputs[0].token_ids for batch in outs for o in batch]

    with_stack = generate(True)
    assert stack_calls and all(stack_calls)
    assert generate(False) == with_stack


def runner_hidden(
    model, tokens: list[int], capture: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Every token's hidden states from one ModelRunner prefill over a fresh paged KV cache."""
    from pagedspec.engine.loader.model_loader import model_kv_shape
    from pagedspec.engine.worker.model_runner import ModelRunner
    from pagedspec.engine.worker.spans import Span
    from pagedspec.memory import allocate_kv_caches

    blocks = -(-len(tokens) // 4)
    caches = allocate_kv_caches(
        *model_kv_shape(model.config), blocks, 4, dtype, torch.device("cpu")
    )
    runner = ModelRunner(model, caches, "cpu", torch.device("cpu"))
    span = Span(tokens, 0, 1, list(reversed(range(blocks))))
    return runner.forward([span], return_hidden=True, hidden_layers=capture).hidden


@pytest.mark.parametrize("capture", [(1,), (0, 1)])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_captured_layers_are_the_python_loops_bits_and_hfs_hidden_states(
    precision, capture, tmp_path, stack_calls
):
    """The hidden states after some of 3 layers (what a fused-feature EAGLE head reads), then
    the final one: the stack's bits equal the Python loop's, the final part equals a run
    without capture, and in float32 every part matches HF's ``output_hidden_states``."""
    hf = save_tiny(CONFIGS["llama"](), tmp_path)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tokens = torch.randint(100, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    fast = runner_hidden(load(tmp_path, precision), tokens, capture, dtype)
    assert stack_calls and all(stack_calls)
    hidden = hf.config.hidden_size
    assert fast.shape == (len(tokens), (len(capture) + 1) * hidden)
    plain = runner_hidden(load(tmp_path, precision), tokens, (), dtype)
    assert torch.equal(fast[:, -hidden:], plain)
    stack_calls.clear()
    slow = runner_hidden(python_loop(load(tmp_path, precision)), tokens, capture, dtype)
    assert not stack_calls
    assert torch.equal(fast, slow)
    if precision == "fp32":
        with torch.no_grad():
            ref = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        wanted = [ref[i + 1] for i in capture] + [ref[-1]]
        for part, want in zip(fast.split(hidden, dim=-1), wanted, strict=True):
            assert (part - want[0]).abs().max() / want[0].abs().max() < 1e-4


@pytest.mark.parametrize("capture", [(1, 0), (0, 0), (3,), (-1,)])
def test_capture_must_be_ascending_layer_indices(capture, tmp_path):
    save_tiny(CONFIGS["llama"](), tmp_path)
    with pytest.raises(ValueError, match="capture must be ascending indices below 3"):
        runner_hidden(load(tmp_path, "fp32"), [1, 2, 3], capture)
