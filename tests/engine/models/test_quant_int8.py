"""Int8 weights (GGUF Q8_0): the quantiser against gguf-py's bits, the C++ kernel
(kernels/csrc/cpu_linear_q8.cpp) against float64 products of its own integer arithmetic (x
quantised per block to int16) and of the plain float x, and the int8 Linear / SwiGLU / tied
embedding built on them."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_files import DEFAULT_MODEL_PROMPTS, TINY, load_cpu, random_hf_model, write_gguf
from paged_harness import PagedHarness
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from pagedspec import LLM, SamplingParams
from pagedspec.engine.config import EngineConfig
from pagedspec.engine.loader.default_model import default_model_dir
from pagedspec.engine.loader.gguf_loader import iter_gguf
from pagedspec.engine.loader.model_loader import load_model
from pagedspec.engine.models import layers, linear
from pagedspec.engine.models.quant import dequantize_q8_0, quantize_q8_0, quantized_weight
from pagedspec.kernels import cpu_extension

Q8_0 = gguf.GGMLQuantizationType.Q8_0
PROMPTS = DEFAULT_MODEL_PROMPTS  # the prompts checked token for token against HF
NEW_TOKENS = 64


def weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows at scales from 1e-3 to 10, with an all-zero block and ties at .5 steps."""
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 1, rows)[:, None]
    w[0, :32] = 0.0
    w[-1, : min(cols, 32)] = torch.arange(min(cols, 32)) * 0.5 - 8  # d = 8/127: ties after scaling
    return w


def gguf_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py's Q8_0 blocks of ``w`` split into (q int8 [N, K], d float16 [N, K / 32])."""
    raw = gguf.quants.quantize(w.numpy(), Q8_0).reshape(w.shape[0], -1, 34)
    d = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0]
    q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(w.shape)
    return torch.from_numpy(q), torch.from_numpy(d)


def reference(x: torch.Tensor, qs, ds, bias=None) -> torch.Tensor:
    """x @ dequantised weight^T + bias in float64."""
    w = dequantize_q8_0(qs, ds).double()
    return F.linear(x.double(), w, None if bias is None else bias.double())


def int16_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's quantisation of x [M, K] per block of 32 (zero-padded), in float32 as it
    computes it: s = max|x| / 32767, xq = round(x * (32767 / max|x|)) to nearest even. (NumPy:
    its float32 division is IEEE's, as C++'s is; torch's scalar / tensor is not always.)
    Where 32767 / max|x| is not finite (max|x| is 0, or below 32767 / FLT_MAX), xq = 0."""
    blocks = -(-x.shape[1] // 32)
    xb = F.pad(x, (0, blocks * 32 - x.shape[1])).view(len(x), blocks, 32).numpy()
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore", over="ignore"):
        quotient = np.float32(32767) / amax
    inv = np.where(np.isfinite(quotient), quotient, np.float32(0))
    xq = np.rint(xb * inv[..., None])
    return torch.from_numpy(xq), torch.from_numpy(amax / np.float32(32767))


def kernel_reference(x: torch.Tensor, qs, ds, bias=None) -> torch.Tensor:
    """What the kernel computes, in float64: sum over blocks of (xq . q) * d * s, + bias."""
    xq, s = int16_blocks(x)
    blocks = xq.shape[1]
    q = F.pad(qs, (0, blocks * 32 - qs.shape[1])).view(len(qs), blocks, 32).double()
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), q)  # exact: integers below 2^53
    out = (dots * ds.double()[None] * s.double()[:, None]).sum(-1)
    return out if bias is None else out + bias.double()


def activation_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far the int16 activations can move x . w^T, per output [M, N], for the dequantised
    weight w [N, K]: each x is rounded to a multiple of its block's s = max|x| / 32767, at most
    s / 2 away (0.51 s: float32's rounding of x * (32767 / max|x|) and of s adds < 0.01 s)."""
    _, s = int16_blocks(x)  # [M, B]
    blocks = s.shape[1]
    w_abs = F.pad(w.double().abs(), (0, blocks * 32 - w.shape[1])).view(len(w), blocks, 32)
    return 0.51 * s.double() @ w_abs.sum(-1).T


def rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("shape", [(1, 32), (37, 96), (96, 576)])
def test_quantize_q8_0_is_gguf_bit_for_bit(shape, gen):
    w = weight(*shape, gen)
    qs, ds = quantize_q8_0(w)
    q_ref, d_ref = gguf_q8_0(w)
    assert torch.equal(qs, q_ref)
    assert torch.equal(ds, d_ref.float())
    deq = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), Q8_0), Q8_0)
    assert torch.equal(dequantize_q8_0(qs, ds), torch.from_numpy(deq))


def test_quantizing_dequantised_q8_0_gives_the_shipped_bits_back(gen):
    """A Q8_0 GGUF loaded as float32 and quantised at load runs exactly the file's numbers."""
    qs, ds = quantize_q8_0(weight(64, 160, gen))
    again = quantize_q8_0(dequantize_q8_0(qs, ds))
    assert torch.equal(again[0], qs) and torch.equal(again[1], ds)


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (64, 32), (96, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_q8_matches_float64_reference(rows, n, k, bias, gen):
    ext = cpu_extension.load()
    qs, ds = quantize_q8_0(weight(n, k, gen))
    packed_q, packed_d = ext.pack_q8_weight(qs, ds)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = ext.linear_q8(x, packed_q, packed_d, b, n)
    assert got.shape == (rows, n)
    # its own arithmetic: float32 sums of nb block terms; a wrong scale, a dropped block or a
    # misplaced pair is off by 1e-3 and more
    assert rel_err(got, kernel_reference(x, qs, ds, b)) < 1e-6
    # the int16 activations cost at most half a step s = max|x| / 32767 of each block, on top
    # of the float32 sums' 1e-6
    exact = reference(x, qs, ds, b)
    slack = activation_error_bound(x, dequantize_q8_0(qs, ds)) + 1e-6 * exact.abs().max()
    assert ((got.double() - exact).abs() <= slack).all()


def test_linear_q8_quantises_each_block_of_its_own_row_rounding_ties_to_even(gen):
    """With identity weights (q = 1 on the diagonal, d = 1) the kernel returns x's int16
    activations times their block's s, exactly. Block maxima of 32767 and 65534 make
    x / s = x and x / 2: ties at n + 0.5 must round to the even neighbour (np.rint), and each
    block (the last one 8 long) must take its max from its own row: the next row starts with a
    larger value. Blocks below 32767 / FLT_MAX (x / s overflows) give 0."""
    ext = cpu_extension.load()
    k = 72  # blocks of 32, 32 and 8
    x = torch.randint(-2000, 2000, (6, k), generator=gen).float() + 0.5
    x[0, :8] = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 4.5])
    x[:, [32, 64]] = 32767.0
    x[:, 0] = torch.tensor([32767.0, 65534.0]).repeat(3)
    x[5, 32:64] = torch.linspace(-1, 1, 32) * 1e-36  # a block of tiny values
    pq, pd = ext.pack_q8_weight(torch.eye(k, dtype=torch.int8), torch.ones(k, 3).half())
    got = ext.linear_q8(x, pq, pd, None, k)
    xq, s = int16_blocks(x)
    expected = (xq * s[..., None]).view(len(x), -1)[:, :k].float()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("n", [200, 216])  # a last group of 1 panel, and of 2 (AVX512)
def test_linear_q8_row_bits_do_not_depend_on_the_batch(n, gen):
    """Rows run alone, in a call of up to 9 rows (one tile of them all up to 8, fewer panels
    per tile) and in a batch of 64 (other row tiles) give the same bits, at any thread count."""
    ext = cpu_extension.load()
    qs, ds = quantize_q8_0(weight(n, 96, gen))
    pq, pd = ext.pack_q8_weight(qs, ds)
    x = torch.randn(64, 96, generator=gen)
    batch = ext.linear_q8(x, pq, pd, None, n)
    for rows in range(1, 10):
        assert torch.equal(ext.linear_q8(x[:rows], pq, pd, None, n), batch[:rows]), rows
    threads = torch.get_num_threads()
    try:
        for t in {1, threads}:
            torch.set_num_threads(t)
            for i in (0, 5, 63):
                assert torch.equal(ext.linear_q8(x[i : i + 1], pq, pd, None, n), batch[i : i + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_swiglu_of_int8_projection_matches_float64(rows, gen, monkeypatch):
    """The fused int8 gate_up + silu * mul (one call) equals the float64 formula on the
    dequantised weights, and is the path taken."""
    ext = cpu_extension.load()
    calls = []
    fused = ext.linear_silu_mul_q8
    monkeypatch.setattr(ext, "linear_silu_mul_q8", lambda *a: calls.append(1) or fused(*a))
    inter, k = 48, 64
    proj = linear.Linear(k, 2 * inter, bias=False).requires_grad_(False)
    proj.weight.data = weight(2 * inter, k, gen)
    qs, ds = quantize_q8_0(proj.weight)
    proj.quantize()
    x = torch.randn(rows, k, generator=gen)
    gate, up = kernel_reference(x, qs, ds).chunk(2, dim=-1)
    got = layers.swiglu(proj, x)
    assert rel_err(got, F.silu(gate) * up) < 2e-6
    assert calls == [1]
    assert torch.equal(got, layers.silu_and_mul(proj(x)))


def test_int8_swiglu_row_does_not_depend_on_how_many_rows_share_the_call(gen):
    """The fused int8 gate_up GEMM's rows: one tile of all rows where the registers hold one
    (fewer panels per tile), or tiles of 3 or 1; a row's bits are the same in each."""
    proj = linear.Linear(64, 2 * 48, bias=False).requires_grad_(False)
    proj.weight.data = weight(2 * 48, 64, gen)
    proj.quantize()
    x = torch.randn(300, 64, generator=gen)
    full = layers.swiglu(proj, x)
    for rows in (*range(1, 10), 13, 257):
        assert torch.equal(layers.swiglu(proj, x[:rows]), full[:rows]), rows


def test_int8_linear_keeps_one_copy_and_unpacks_dequantised(gen):
    lin = linear.Linear(64, 40).requires_grad_(False)
    lin.weight.data = weight(40, 64, gen)
    qs, ds = quantize_q8_0(lin.weight)
    lin.quantize()
    assert lin.weight.untyped_storage().nbytes() == 4  # the placeholder: no float copy left
    assert quantized_weight(lin.weight).q.dtype == torch.int8
    x = torch.randn(3, 5, 64, generator=gen)
    assert rel_err(lin(x), kernel_reference(x.view(-1, 64), qs, ds, lin.bias).view(3, 5, 40)) < 2e-6
    assert torch.equal(lin.state_dict()["weight"], dequantize_q8_0(qs, ds))
    lin.unpack()
    assert quantized_weight(lin.weight) is None
    assert torch.equal(lin.weight, dequantize_q8_0(qs, ds))


def test_tied_embedding_reads_the_int8_head(gen):
    emb = linear.Embedding(50, 64)
    head = linear.Linear(64, 50, bias=False)
    head.weight = emb.weight
    emb.requires_grad_(False)
    emb.weight.data = weight(50, 64, gen)
    qs, ds = quantize_q8_0(emb.weight)
    head.quantize()
    ids = torch.tensor([[0, 49, 17], [3, 3, 16]])
    assert torch.equal(emb(ids), dequantize_q8_0(qs, ds)[ids])
    with pytest.raises(IndexError):
        emb(torch.tensor([50]))


def test_kernel_rejects_mismatched_packs(gen):
    ext = cpu_extension.load()
    qs, ds = quantize_q8_0(weight(32, 64, gen))
    with pytest.raises(ValueError, match="scales must be float32 or float16"):
        ext.pack_q8_weight(qs, ds[:, :1])
    with pytest.raises(ValueError, match="scales must be float16 values"):
        ext.pack_q8_weight(qs, ds * (1 + 1e-6))
    pq, pd = ext.pack_q8_weight(qs, ds)
    with pytest.raises(ValueError, match="x must be a float32"):
        ext.linear_q8(torch.randn(2, 32), pq, pd, None, 32)
    with pytest.raises(ValueError, match="pack_q8_weight"):
        ext.linear_q8(torch.randn(2, 64), pq, pd[:, :1], None, 32)


@pytest.mark.parametrize("value", ["int4", "INT8", "", 8])
def test_bad_quantization_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match=r"quantization must be one of \(None, 'int8', 'q4_1'\)"):
        EngineConfig(quantization=value)


def test_q8_0_gguf_runs_its_shipped_numbers(tmp_path):
    """A Q8_0 GGUF loaded with quantization="int8": every Linear (a tied LM head too) holds
    exactly the file's dequantised values, and the logits match HF loading the same file."""
    hf = random_hf_model(LlamaConfig(**TINY), seed=2)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, path, "llama", Q8_0)
    ours = load_cpu(path, quantization="int8")
    shipped = dict(iter_gguf(gguf.GGUFReader(path), ours.config))
    state = ours.model.state_dict()  # int8 weights come back dequantised
    linears = [m for m in ours.model.modules() if isinstance(m, linear.Linear)]
    assert linears and all(quantized_weight(m.weight).format == "q8_0" for m in linears)
    for name, value in shipped.items():  # the tied LM head is embed_tokens.weight
        fused, part = ours.model._param_name(name)
        sizes = ours.model._shard_sizes(fused)
        got = state[fused].narrow(0, sum(sizes[:part]), sizes[part])
        assert torch.equal(got, value), name
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    tokens = torch.randint(257, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    (logits,) = PagedHarness(ours.model, num_seqs=1, max_len=19).step([(0, tokens)])
    with torch.no_grad():
        expected = ref.eval()(torch.tensor([tokens])).logits[0]
    assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-4


def default_model_scores_of(quantization: str) -> dict:
    """The default model's prompts continued greedily by the float32 default model; then its
    and the ``quantization`` model's log-probabilities over prompt + that continuation
    (teacher-forced: a divergence does not carry on into different text)."""
    models = {
        q: load_model(None, "float32", "cpu", quantization=q).model for q in (None, quantization)
    }
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    harness = PagedHarness(models[None], len(prompts), max_len=128, block_size=16)
    continuations = harness.greedy(prompts, NEW_TOKENS)
    scores = {}
    for q, model in models.items():
        harness = PagedHarness(model, len(prompts), max_len=128, block_size=16)
        chunks = [(i, p + c) for i, (p, c) in enumerate(zip(prompts, continuations, strict=True))]
        logits = harness.step(chunks)
        # rows predicting each continuation token
        scores[q] = [
            lg[len(p) - 1 : -1].double().log_softmax(-1)
            for lg, p in zip(logits, prompts, strict=True)
        ]
    return {"continuations": continuations, **scores}


def agreement_with_float32(scores: dict, quantization: str) -> tuple[float, torch.Tensor]:
    """(share of positions where the quantised model's argmax is float32's greedy token,
    |log-probability difference| of that token at every position) of default_model_scores_of."""
    same = total = 0
    diffs = []
    for tokens, lp32, lpq in zip(
        scores["continuations"], scores[None], scores[quantization], strict=True
    ):
        ids = torch.tensor(tokens)
        assert torch.equal(lp32.argmax(-1), ids)  # (the continuation is float32's greedy one)
        same += int((lpq.argmax(-1) == ids).sum())
        total += len(ids)
        diffs.append((lpq - lp32).gather(1, ids[:, None]).abs())
    diffs = torch.cat(diffs)
    print(f"agreement {same}/{total}, logprob diff max {diffs.max():.4f} mean {diffs.mean():.4f}")
    return same / total, diffs


def test_int8_default_model_agrees_with_float32():
    """SmolLM2-135M (its Q4_1 weights, requantised to Q8_0), 4 prompts x 64 tokens continued by
    the float32 model: int8's argmax is float32's at >= 93% of the positions (measured on
    AVX512: 246 / 256, 96%), and its log-probability of float32's token is within 0.3 of
    float32's, 0.04 on average (measured: 0.21 and 0.021)."""
    agreement, diffs = agreement_with_float32(default_model_scores_of("int8"), "int8")
    assert agreement >= 0.93
    assert diffs.max() < 0.3 and diffs.mean() < 0.04


def test_int8_with_bfloat16_or_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="quantization='int8' runs on the CPU in float32"):
        LLM(quantization="int8", dtype="bfloat16", load_format="dummy")


def test_int8_greedy_is_the_same_with_speculation_and_any_batch(tiny_llama):
    """Scheduling never changes int8 results: each request alone, nine together (past the
    8-row tile: the panel-buffer path), and the three under n-gram speculation (verification
    spans of several rows) give the same tokens."""
    prompts = ["hello world hello world hello", "the cat sat on the mat the cat", "abc abc abc"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(llm: LLM, batch: list[str]) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]

    plain = LLM(tiny_llama, quantization="int8", num_kv_blocks=128)
    alone = [run(plain, [p])[0] for p in prompts]
    assert run(plain, prompts * 3)[: len(prompts)] == alone
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    fast = LLM(tiny_llama, quantization="int8", num_kv_blocks=128, speculative_config=spec)
    assert run(fast, prompts) == alone
    assert fast.llm_engine.get_stats().num_accepted_tokens > 0
