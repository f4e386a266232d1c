"""The bf16 packed GEMM (kernels/csrc/cpu_linear_bf16.cpp) and the bf16 CPU layer ops.

The oracle is float64 arithmetic on the bf16-rounded weights and inputs: the kernel sums in
float32 and rounds its result to bf16 once, so each output element must sit within half a bf16
ulp of the exact value plus float32 summation error. Both of the kernel's paths run here: the
AVX512-BF16 dot product (where this CPU has it) and the widening path (shift + FMA) that AVX2
builds and older AVX512 CPUs run; ``make test`` reruns this file on the AVX2 build.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import build_random_llama
from transformers import LlamaForCausalLM

from pagedspec import LLM, SamplingParams
from pagedspec.engine.models import layers, linear
from pagedspec.engine.models.linear import Embedding, Linear
from pagedspec.kernels import cpu_extension

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="C++ extension not built")

ROWS = (1, 2, 3, 17, 64)
# (out_features, in_features): whole panels and K even (packed in place); a padded last panel
# and a tile of fewer than 4 panels; odd K (a zero-padded k pair); fewer columns than a panel.
SHAPES = [(64, 48), (35, 40), (100, 7), (3, 1), (960, 96)]


def paths() -> list[bool]:
    """The dot flags that select distinct paths here (True runs the dot product where built)."""
    ext = cpu_extension.load()
    return [True, False] if ext.linear_bf16_has_dot() else [False]


def exact_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out if bias is None else out + bias.double()


def assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias, where=""):
    """Within half a bf16 ulp of the float64 product, plus float32 rounding of the sums."""
    exact = exact_product(x, w, bias)
    scale = x.double().abs() @ w.double().abs().t()  # bounds the summation error
    if bias is not None:
        scale = scale + bias.double().abs()
    half_ulp = 2.0**-8 if got.dtype == torch.bfloat16 else 0.0
    allowed = half_ulp * exact.abs() + 1e-6 * scale + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= allowed).all()), f"{where}: worst excess {float((err - allowed).max())}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_kernel_matches_float64_reference(shape, bias, gen):
    ext = cpu_extension.load()
    n, k = shape
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = ext.pack_linear_weight_bf16(w)
    for dot in paths():
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            out = ext.linear_bf16(x, packed, b, n, dot)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            assert_bf16_close(out, x, w, b, f"dot={dot} rows={rows}")


def test_bf16_kernel_takes_float32_activations(gen):
    """float32 x: the widening path keeps it exact (float32 out); the dot product rounds x to
    bf16 first."""
    ext = cpu_extension.load()
    w = torch.randn(35, 40, generator=gen).bfloat16()
    packed = ext.pack_linear_weight_bf16(w)
    x = torch.randn(5, 40, generator=gen)
    for dot in paths():
        out = ext.linear_bf16(x, packed, None, 35, dot)
        assert out.dtype == torch.float32
        used_x = x.bfloat16() if dot else x
        assert_bf16_close(out, used_x, w, None, f"dot={dot}")


def test_bf16_kernel_row_does_not_depend_on_its_batch_or_threads(gen):
    ext = cpu_extension.load()
    w = torch.randn(200, 64, generator=gen).bfloat16()
    packed = ext.pack_linear_weight_bf16(w)
    x = torch.randn(300, 64, generator=gen).bfloat16()
    saved = torch.get_num_threads()
    try:
        for dot in paths():
            torch.set_num_threads(2)
            full = ext.linear_bf16(x, packed, None, 200, dot)
            torch.set_num_threads(1)
            assert torch.equal(full, ext.linear_bf16(x, packed, None, 200, dot))
            for i in (0, 7, 299):
                assert torch.equal(
                    full[i : i + 1], ext.linear_bf16(x[i : i + 1], packed, None, 200, dot)
                )
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize(("inter", "k"), [(48, 24), (16, 9), (160, 64)])
def test_bf16_gated_kernel_matches_float64_formula(inter, k, gen):
    ext = cpu_extension.load()
    w = torch.randn(2 * inter, k, generator=gen).bfloat16()
    gate, up = w.double().chunk(2)
    packed = ext.pack_linear_weight_bf16(w)
    for dot in paths():
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            got = ext.linear_silu_mul_bf16(x, packed, inter, dot)
            x64 = x.double()
            exact = F.silu(x64 @ gate.t()) * (x64 @ up.t())
            scale = (x64.abs() @ gate.abs().t()) * (x64.abs() @ up.abs().t())
            err = (got.double() - exact).abs()
            assert bool((err <= 2.0**-8 * exact.abs() + 1e-5 * scale + 1e-30).all()), (dot, rows)


def test_bf16_pack_in_place_and_unpacked_round_trip(gen):
    ext = cpu_extension.load()
    for n, k in [(64, 48), (35, 40), (32, 7)]:
        w = torch.randn(n, k, generator=gen).bfloat16()
        copy = w.clone()
        packed = ext.pack_linear_weight_bf16_(w)
        in_place = n % 16 == 0 and k % 2 == 0
        assert (packed.data_ptr() == w.data_ptr()) == in_place
        assert packed.shape == ((n + 15) // 16, (k + 1) // 2, 16, 2)
        assert torch.equal(packed, ext.pack_linear_weight_bf16(copy))
        assert torch.equal(linear.unpacked(packed, (n, k)), copy)


@pytest.mark.parametrize(
    ("match", "call"),
    [
        (
            "x must be",
            lambda e, p: e.linear_bf16(torch.ones(2, 40, dtype=torch.float64), p, None, 35),
        ),
        ("x must be", lambda e, p: e.linear_bf16(torch.ones(2, 38).bfloat16(), p, None, 35)),
        ("out_features", lambda e, p: e.linear_bf16(torch.ones(2, 40).bfloat16(), p, None, 60)),
        ("bias", lambda e, p: e.linear_bf16(torch.ones(2, 40).bfloat16(), p, torch.ones(3), 35)),
        ("packed", lambda e, p: e.linear_bf16(torch.ones(2, 40).bfloat16(), p.float(), None, 35)),
        ("gate_up", lambda e, p: e.linear_silu_mul_bf16(torch.ones(2, 40).bfloat16(), p, 17)),
        ("weight", lambda e, p: e.pack_linear_weight_bf16(torch.ones(4, 4))),
    ],
)
def test_bf16_kernel_rejects_bad_input(match, call):
    ext = cpu_extension.load()
    packed = ext.pack_linear_weight_bf16(torch.ones(35, 40).bfloat16())
    with pytest.raises(ValueError, match=match):
        call(ext, packed)


def bf16_linear(n: int, k: int, bias: bool, gen: torch.Generator) -> tuple[Linear, torch.Tensor]:
    layer = Linear(k, n, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    layer.weight.data = torch.randn(n, k, generator=gen).bfloat16()
    if bias:
        layer.bias.data = torch.randn(n, generator=gen).bfloat16()
    plain = layer.weight.detach().clone()
    layer.prepack()
    return layer, plain


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_runs_the_kernel_at_every_row_count(bias, gen, monkeypatch):
    """A packed bf16 Linear keeps one copy (the pack) and runs the kernel whatever the rows."""
    ext = cpu_extension.load()
    calls = []
    kernel = ext.linear_bf16
    monkeypatch.setattr(ext, "linear_bf16", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    layer, plain = bf16_linear(35, 40, bias, gen)
    assert layer.packed is not None and layer.packed.dim() == 4
    assert torch.isnan(layer.weight).all()  # one copy: the pack
    for shape in [(1, 40), (3, 40), (2, 9, 40), (300, 40)]:
        x = torch.randn(shape, generator=gen).bfloat16()
        got = layer(x)
        assert got.shape == (*shape[:-1], 35) and got.dtype == torch.bfloat16
        flat = x.reshape(-1, 40)
        assert_bf16_close(got.reshape(-1, 35), flat, plain, layer.bias, str(shape))
    assert calls == [1, 3, 18, 300]


def test_bf16_swiglu_fuses_the_gated_kernel(gen, monkeypatch):
    ext = cpu_extension.load()
    calls = []
    fused = ext.linear_silu_mul_bf16
    monkeypatch.setattr(ext, "linear_silu_mul_bf16", lambda *a: calls.append(1) or fused(*a))
    proj, plain = bf16_linear(96, 40, False, gen)
    x = torch.randn(3, 40, generator=gen).bfloat16()
    got = layers.swiglu(proj, x)
    gate, up = plain.double().chunk(2)
    exact = F.silu(x.double() @ gate.t()) * (x.double() @ up.t())
    assert calls == [1]
    torch.testing.assert_close(got.double(), exact, atol=0.02, rtol=0.02)


def test_tied_bf16_embedding_reads_the_heads_pack(gen):
    """A tied LM head's prepack packs the shared Parameter; the embedding then looks its rows
    up in the bf16 pack ([N/16, K/2, 16, 2]) and gets the weight's rows exactly."""
    emb = Embedding(70, 48, dtype=torch.bfloat16).requires_grad_(False)
    emb.weight.data = torch.randn(70, 48, generator=gen).bfloat16()
    head = Linear(48, 70, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    head.weight = emb.weight
    plain = emb.weight.detach().clone()
    head.prepack()
    assert head.packed is not None and torch.isnan(emb.weight).all()
    ids = torch.tensor([[0, 69, 17], [16, 15, 33]])
    assert torch.equal(emb(ids), plain[ids])
    state = head.state_dict()  # the plain weight, not the placeholder
    assert torch.equal(state["weight"], plain)


@pytest.mark.parametrize("shape", [(1, 64), (5, 576), (3, 2, 96)])
def test_bf16_layer_ops_match_hf_formulas(shape, gen, monkeypatch):
    """RMSNorm (rounded where HF's bf16 module rounds: x * inv_rms, then the weight product),
    rope and silu_and_mul in bf16: the C++ ops against the PyTorch formulas in float64."""
    assert layers._layer_op_cpu(torch.ones(2).bfloat16(), torch.ones(2).bfloat16())
    assert not layers._layer_op_cpu(torch.ones(2).bfloat16(), torch.ones(2))  # mixed: PyTorch
    with pytest.raises(ValueError, match="weight"):
        cpu_extension.load().rms_norm(torch.ones(2, 4).bfloat16(), torch.ones(4), 1e-6)
    x = torch.randn(shape, generator=gen).bfloat16()
    norm = layers.RMSNorm(shape[-1], 1e-6).to(torch.bfloat16).requires_grad_(False)
    norm.weight.data = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).bfloat16()
    got = norm(x)
    x32 = x.float()
    hf = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), hf.float(), atol=0, rtol=2**-7)

    gate_up = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).bfloat16()
    g, u = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(
        layers.silu_and_mul(gate_up).double(), F.silu(g) * u, atol=1e-6, rtol=2**-8
    )

    t, d = 4, shape[-1]
    q = torch.randn(t, 3, d, generator=gen).bfloat16()
    angle = torch.randn(t, d // 2, generator=gen).repeat(1, 2)
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    half = d // 2
    q64 = q.double()
    rotated = torch.cat((-q64[..., half:], q64[..., :half]), dim=-1)
    exact = q64 * cos.double()[:, None] + rotated * sin.double()[:, None]
    got = layers.apply_rotary(q, cos, sin)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, atol=1e-6, rtol=2**-8)


# The engine in bf16 against HF transformers in bf16, both against float64 truth. bf16 rounds
# every activation to 8 bits of mantissa, and the two round in different places (HF rounds each
# rope and SwiGLU op, the C++ ops round once; summation orders differ), so neither matches the
# other's bits: the engine must be as close to float64 as HF's bf16 is (within 1.5x + 0.02
# nats on every generated token's logprob), and its greedy picks must be float64's best or a
# near-tie there.
VOCAB = 64
MAX_TOKENS = 12
BF16_TOL = 0.02


@pytest.fixture(scope="module", params=["untied", "tied"])
def bf16_target(request, tmp_path_factory) -> str:
    tied = request.param == "tied"
    return build_random_llama(
        tmp_path_factory.mktemp(f"bf16_{request.param}"), seed=31, vocab_size=VOCAB,
        tie_word_embeddings=tied, **({"std": 0.1} if tied else {}),
    )  # fmt: skip


def test_bf16_engine_tracks_float64_as_closely_as_hf_bf16(bf16_target):
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 9, 23, 40)]
    llm = LLM(bf16_target, dtype="bfloat16", num_kv_blocks=64)
    model = llm.llm_engine.runner.model
    packs = [m.packed for m in model.modules() if isinstance(m, Linear)]
    assert packs and all(p is not None and p.dtype == torch.bfloat16 for p in packs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = LlamaForCausalLM.from_pretrained(bf16_target, torch_dtype=torch.bfloat16).eval()
    hf64 = LlamaForCausalLM.from_pretrained(bf16_target, torch_dtype=torch.float64).eval()
    ours_err, hf_err, agree = [], [], 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.no_grad():
            exact = hf64(ids).logits[0, len(prompt) - 1 :].log_softmax(-1)
            theirs = hf(ids).logits[0, len(prompt) - 1 :].double().log_softmax(-1)
        for j, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            ours_err.append(abs(entry[token] - float(exact[j, token])))
            hf_err.append(abs(float(theirs[j, token]) - float(exact[j, token])))
            # greedy: float64's best, or within our error of it
            assert float(exact[j, token]) >= float(exact[j].max()) - 2 * BF16_TOL - ours_err[-1]
            agree += token == int(theirs[j].argmax())
    assert max(ours_err) <= 1.5 * max(hf_err) + BF16_TOL, (max(ours_err), max(hf_err))
    assert agree >= 0.9 * len(ours_err)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
