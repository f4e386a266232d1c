"""Our packed, paged forward against HF's full-sequence forward on tiny random models."""

import pytest
import torch
import torch.nn.functional as F
from paged_harness import PagedHarness
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedspec.engine.loader.model_loader import load_model, model_kv_shape
from pagedspec.engine.models import LlamaForCausalLM, get_model_class
from pagedspec.engine.models.linear import Embedding, Linear
from pagedspec.kernels import cpu_extension

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "llama-tied-llama3-rope": lambda: LlamaConfig(
        **COMMON, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE
    ),
    "llama-linear-rope-bias": lambda: LlamaConfig(
        **COMMON,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0},
    ),
    "llama-yarn-rope": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=4096),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),
}

# Chunks per step: (sequence, number of new tokens). Sequences 1 and 3 prefill in chunks across
# steps, sequence 4 arrives late, and everyone else decodes one token per step meanwhile.
SCHEDULE = [
    [(0, 7), (1, 5), (2, 1), (3, 8)],
    [(0, 1), (1, 9), (2, 1), (3, 8), (4, 11)],
    [(0, 1), (1, 1), (2, 1), (3, 3), (4, 1)],
    [(0, 1), (1, 1), (3, 1), (4, 1)],
    [(1, 1), (3, 1), (4, 1)],
]


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every parameter matter: O(1) activations, norms away from 1, biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)


def save_tiny(config, path, seed: int = 0, **save_kwargs) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize_(hf, seed)
    hf.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return hf


def run_schedule(
    model, schedule, seed: int = 0, backend: str = "torch"
) -> dict[int, tuple[list[int], torch.Tensor]]:
    """Feed random tokens per the schedule; returns each sequence's tokens and our logits."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = 1 + max(seq for step in schedule for seq, _ in step)
    total = [sum(n for step in schedule for s, n in step if s == seq) for seq in range(num_seqs)]
    tokens = [torch.randint(VOCAB, (n,), generator=gen).tolist() for n in total]
    harness = PagedHarness(model, num_seqs, max(total), block_size=4, backend=backend, seed=seed)
    fed = [0] * num_seqs
    logits: list[list[torch.Tensor]] = [[] for _ in range(num_seqs)]
    for step in schedule:
        chunks = [(s, tokens[s][fed[s] : fed[s] + n]) for s, n in step]
        for (s, n), out in zip(step, harness.step(chunks), strict=True):
            fed[s] += n
            logits[s].append(out)
    return {s: (tokens[s], torch.cat(logits[s])) for s in range(num_seqs)}


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("backend", ["torch", "cpu", "torch-without-extension"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_paged_logits_match_hf(name, backend, tmp_path, monkeypatch):
    if backend == "torch-without-extension":  # the path of a machine without a C++ compiler
        monkeypatch.setattr(cpu_extension, "available", lambda: False)
        backend = "auto"
    config = CONFIGS[name]()
    hf = save_tiny(config, tmp_path)
    ours = load_model(str(tmp_path), dtype="float32", device="cpu").model
    for seq, (tokens, logits) in run_schedule(ours, SCHEDULE, backend=backend).items():
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0].float()
        assert logits.dtype == torch.float32 and logits.shape == ref.shape
        assert max_rel_err(logits, ref) < 1e-4, f"sequence {seq}"


@pytest.mark.parametrize("name", ["llama-tied-llama3-rope", "qwen3"])
def test_triton_backend_matches_hf(name, tmp_path):
    # On CPU the Triton kernels run in Triton's interpreter: a short schedule keeps this quick.
    hf = save_tiny(CONFIGS[name](), tmp_path)
    ours = load_model(str(tmp_path), dtype="float32", device="cpu").model
    for seq, (tokens, logits) in run_schedule(ours, SCHEDULE[:3], backend="triton").items():
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0]
        assert max_rel_err(logits, ref) < 1e-4, f"sequence {seq}"


def test_sharded_checkpoint_matches_single_file(tmp_path):
    config = CONFIGS["qwen2"]()
    save_tiny(config, tmp_path / "single", seed=3)
    save_tiny(config, tmp_path / "sharded", seed=3, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    single = load_model(str(tmp_path / "single"), dtype="float32", device="cpu").model
    sharded = load_model(str(tmp_path / "sharded"), dtype="float32", device="cpu").model
    for (name, a), (_, b) in zip(
        single.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_fused_projections_stack_hf_weights(tmp_path):
    hf = save_tiny(CONFIGS["qwen2"](), tmp_path, seed=5)
    ours = load_model(str(tmp_path), dtype="float32", device="cpu").model
    hf_attn, hf_mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    attn, mlp = ours.model.layers[1].self_attn, ours.model.layers[1].mlp
    qkv = [hf_attn.q_proj, hf_attn.k_proj, hf_attn.v_proj]
    assert torch.equal(attn.qkv_proj.state_dict()["weight"], torch.cat([m.weight for m in qkv]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat([m.bias for m in qkv]))
    assert attn.o_proj.bias is None
    gate_up = torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight])
    assert torch.equal(mlp.gate_up_proj.state_dict()["weight"], gate_up)


def test_tied_head_shares_embedding(tmp_path):
    save_tiny(CONFIGS["llama-tied-llama3-rope"](), tmp_path)
    model = load_model(str(tmp_path), dtype="float32", device="cpu").model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bfloat16_logits_are_float32_and_close(tmp_path):
    config = CONFIGS["qwen3"]()
    save_tiny(config, tmp_path)
    fp32 = load_model(str(tmp_path), dtype="float32", device="cpu").model
    bf16 = load_model(str(tmp_path), dtype="bfloat16", device="cpu").model
    assert bf16.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32
    schedule = SCHEDULE[:2]
    ref, low = run_schedule(fp32, schedule), run_schedule(bf16, schedule)
    for seq in ref:
        assert low[seq][1].dtype == torch.float32
        assert max_rel_err(low[seq][1], ref[seq][1]) < 5e-2


def test_kv_shape_and_max_model_len():
    config = CONFIGS["qwen3"]()
    assert model_kv_shape(config) == (2, 2, 32)
    assert model_kv_shape(CONFIGS["llama"]()) == (2, 2, 16)
    mistral = MistralConfig(**{**COMMON, "max_position_embeddings": 512}, sliding_window=64)
    assert LlamaForCausalLM(mistral).max_model_len == 64
    assert LlamaForCausalLM(CONFIGS["mistral"]()).max_model_len == 128
    assert LlamaForCausalLM(CONFIGS["qwen2"]()).max_model_len == 128


def test_unsupported_configs_raise():
    with pytest.raises(ValueError, match="'gpt2'.*supported"):
        get_model_class(GPT2Config())
    dynamic = LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        LlamaForCausalLM(dynamic)
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaForCausalLM(LlamaConfig(**COMMON, hidden_act="gelu"))


@pytest.mark.parametrize("name", ["llama", "llama-tied-llama3-rope"])
def test_model_is_built_on_the_context_device(name):
    # Built on the meta device (as load_model does), parameters stay there and nothing is
    # initialised; only the rope frequencies are computed, on the CPU, for load_model to move.
    with torch.device("meta"):
        model = LlamaForCausalLM(CONFIGS[name]())
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert torch.equal(
        model.model.rotary_emb.inv_freq, LlamaForCausalLM(CONFIGS[name]()).model.rotary_emb.inv_freq
    )


needs_extension = pytest.mark.skipif(
    not cpu_extension.available(), reason="the C++ CPU kernels cannot be built here"
)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("prepack", [False, pytest.param(True, marks=needs_extension)])
@pytest.mark.parametrize("out_features", [36, 35])  # 35: no row split with 2 or 4 threads
def test_cpu_linear_fast_paths_equal_linear(threads, bias, prepack, out_features, gen):
    """A plain weight: 1-2 rows take the row-split bmm, 3+ F.linear; a packed one: the C++ kernel
    at every row count. All must give F.linear's product, laid out contiguously, for any row
    and thread count."""
    layer = Linear(48, out_features, bias=bias)
    plain = layer.weight.detach().clone()
    if prepack:
        layer.requires_grad_(False).prepack()
        assert layer.packed is not None
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for shape in [(1, 48), (2, 48), (3, 48), (9, 48), (300, 48), (1, 2, 48), (2, 3, 48)]:
                x = torch.randn(shape, generator=gen)
                got = layer(x)
                assert got.shape == (*shape[:-1], out_features) and got.is_contiguous()
                torch.testing.assert_close(got, F.linear(x, plain, layer.bias))
    finally:
        torch.set_num_threads(saved)


@needs_extension
def test_packed_linear_row_does_not_depend_on_how_many_rows_share_the_call(gen):
    """Every output is one in-order sum over the inputs: the same bits for a row alone, in a
    single tile of up to 8 rows (fewer panels per tile), in tiles of 8 and their parts, or past
    the 256-row chunk."""
    layer = Linear(70, 100).requires_grad_(False)
    layer.prepack()
    x = torch.randn(300, 70, generator=gen)
    full = layer(x)
    for rows in (*range(1, 10), 13, 257):
        assert torch.equal(layer(x[:rows]), full[:rows])
    assert torch.equal(layer(x[290:])[-3:], full[-3:])


@needs_extension
@pytest.mark.parametrize("out_features", [32, 35])  # 32: packed in place; 35: a padded panel
def test_packed_linear_keeps_one_copy_and_retires_the_pack_when_the_weight_changes(
    out_features, gen
):
    layer = Linear(24, out_features, bias=False).requires_grad_(False)
    plain, memory = layer.weight.detach().clone(), layer.weight.data_ptr()
    layer.prepack()
    x = torch.randn(5, 24, generator=gen)
    assert layer._pack_is_current()
    assert (layer.packed.data_ptr() == memory) == (out_features == 32)  # whole panels: in place
    # the plain data is gone: a 4-byte NaN placeholder of the right shape, dtype and device
    weight = layer.weight
    assert weight.shape == (out_features, 24) and weight.untyped_storage().nbytes() == 4
    assert weight.isnan().all()
    with pytest.raises(RuntimeError):
        weight.mul_(2)  # nothing can be written into it (load_state_dict neither)
    torch.testing.assert_close(layer(x), F.linear(x, plain))
    assert torch.equal(layer.state_dict()["weight"], plain)
    layer.weight = torch.nn.Parameter(torch.randn(out_features, 24, generator=gen))
    assert not layer._pack_is_current() and layer.packed is None
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    layer.requires_grad_(False).prepack()
    assert layer._pack_is_current()
    layer.weight.data = plain.clone()  # new data: the pack is retired
    assert layer.packed is None
    torch.testing.assert_close(layer(x), F.linear(x, plain))
    layer.prepack()
    layer.double()  # moved or cast: unpacked first
    assert layer.packed is None and torch.equal(layer.weight, plain.double())


@needs_extension
def test_tied_embedding_reads_rows_from_the_head_pack(gen):
    embed = Embedding(35, 24)  # 35 rows: the pack has a padded panel
    head = Linear(24, 35, bias=False)
    head.weight = embed.weight
    plain = embed.weight.detach().clone()
    head.requires_grad_(False).prepack()
    assert embed.weight.untyped_storage().nbytes() == 4  # one copy: the head's pack
    ids = torch.tensor([[0, 34, 17], [16, 15, 33]])
    assert torch.equal(embed(ids), F.embedding(ids, plain))
    for bad in (35, 40, -1):  # 35..47 would be the pack's zero padding, -1 its last row
        with pytest.raises(IndexError, match="35"):
            embed(torch.tensor([bad]))
    assert torch.equal(embed.state_dict()["weight"], plain)
    embed.double()  # unpacks the shared weight: the head's pack goes with it
    assert head.packed is None and torch.equal(head.weight, plain.double())


@needs_extension
def test_linear_with_trainable_weights_keeps_its_gradient(gen):
    layer = Linear(32, 16)
    layer.prepack()
    x = torch.randn(5, 32, generator=gen)
    layer(x).sum().backward()  # the C++ kernel has no autograd: F.linear must run
    torch.testing.assert_close(layer.weight.grad, torch.ones(16, 5) @ x)


@needs_extension
@pytest.mark.parametrize("trainable", ["input", "bias"])
def test_packed_linear_keeps_the_gradient_of_a_trainable_input_or_bias(trainable, gen):
    """A frozen, packed weight: the product must still carry the gradient of x or of the bias
    (the C++ kernel has none, so F.linear runs)."""
    layer = Linear(32, 16).requires_grad_(False)
    plain = layer.weight.detach().clone()
    layer.prepack()
    x = torch.randn(5, 32, generator=gen, requires_grad=trainable == "input")
    layer.bias.requires_grad_(trainable == "bias")
    layer(x).sum().backward()
    if trainable == "input":
        torch.testing.assert_close(x.grad, torch.ones(5, 16) @ plain)
    else:
        torch.testing.assert_close(layer.bias.grad, torch.full((16,), 5.0))


@needs_extension
def test_loaded_cpu_model_is_prepacked(tmp_path):
    save_tiny(CONFIGS["llama"](), tmp_path)
    model = load_model(str(tmp_path), dtype="float32", device="cpu").model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m._pack_is_current() for m in linears)
    # one copy of the weights: the packs (a few padding columns; their own bytes, as they share
    # one mapping on 2 MB pages) and the unpacked rest
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    packs = sum(m.packed.numel() * m.packed.element_size() for m in linears)
    plain = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert weight_bytes <= packs + plain <= 1.05 * weight_bytes
    bf16 = load_model(str(tmp_path), dtype="bfloat16", device="cpu").model
    linears = [m for m in bf16.modules() if isinstance(m, Linear)]  # the bf16 kernel's packs
    assert all(m._pack_is_current() and m.packed.dtype == torch.bfloat16 for m in linears)
    weight_bytes = sum(p.numel() * 2 for p in bf16.parameters())
    packs = sum(m.packed.numel() * m.packed.element_size() for m in linears)
    plain = sum(p.untyped_storage().nbytes() for p in bf16.parameters())
    assert weight_bytes <= packs + plain <= 1.05 * weight_bytes


def test_model_loads_and_runs_under_inference_mode(tmp_path):
    save_tiny(CONFIGS["llama"](), tmp_path)
    reference = run_schedule(load_model(str(tmp_path), dtype="float32", device="cpu").model,
                             SCHEDULE[:2])  # fmt: skip
    with torch.inference_mode():
        model = load_model(str(tmp_path), dtype="float32", device="cpu").model
    got = run_schedule(model, SCHEDULE[:2])
    for seq in reference:
        torch.testing.assert_close(got[seq][1], reference[seq][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_only_fp32_cpu_linear_splits_rows_across_threads(dtype, gen, monkeypatch):
    """A plain bf16 weight takes F.linear (oneDNN: 1.5x the row-split bmm at 1-2 rows on the dev
    CPU); the split is for fp32, which MKL would run on one core. Both: F.linear's product."""
    layer = Linear(576, 96, bias=False, dtype=dtype).requires_grad_(False)
    splits = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: splits.append(1) or bmm(*a))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (1, 2, 3):
            x = torch.randn(rows, 576, generator=gen).to(dtype)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    finally:
        torch.set_num_threads(saved)
    assert len(splits) == (2 if dtype == torch.float32 else 0)
