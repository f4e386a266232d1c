"""The fused C++ layer ops (RMSNorm, rope, SwiGLU) against the PyTorch formulas they replace."""

import pytest
import torch
import torch.nn.functional as F

from pagedspec.engine.models import layers, linear
from pagedspec.kernels import cpu_extension


def formula(monkeypatch, fn, *args):
    """fn's PyTorch path, with the extension hidden (float64 inputs: the exact value)."""
    with monkeypatch.context() as m:
        m.setattr(cpu_extension, "available", lambda: False)
        return fn(*(a.double() for a in args)).float()


def close(got: torch.Tensor, exact: torch.Tensor, tol: float = 2e-6) -> bool:
    return float((got.double() - exact.double()).abs().max() / exact.abs().max()) <= tol


def test_fused_ops_are_used_on_cpu_float32():
    x = torch.randn(2, 8)
    assert linear.fused_cpu(x)
    assert not linear.fused_cpu(x.double())
    assert not linear.fused_cpu(x.bfloat16())
    assert not linear.fused_cpu(x.requires_grad_())


@pytest.mark.parametrize("shape", [(1, 576), (37, 64), (5, 3, 24)])
def test_fused_rms_norm_matches_formula(shape, gen, monkeypatch):
    norm = layers.RMSNorm(shape[-1], eps=1e-5)
    norm.weight.data = torch.randn(shape[-1], generator=gen)
    x = torch.randn(shape, generator=gen) * 3
    with torch.no_grad():
        got = norm(x)
        exact = formula(monkeypatch, norm.double(), x)
    assert got.shape == x.shape and close(got, exact)


@pytest.mark.parametrize("shape", [(1, 576), (37, 64), (5, 3, 24)])
def test_rms_norm_with_residual_gives_the_bits_of_the_add_then_the_norm(shape, gen, monkeypatch):
    """The decoder layer's residual add fused into the next norm: (norm(x + r), x + r) bit for
    bit as the two steps, written in place into x and r; a strided x takes the unfused path
    to the same bits, and both are the float64 formula's value."""
    norm = layers.RMSNorm(shape[-1], eps=1e-5).requires_grad_(False)
    norm.weight.data = torch.randn(shape[-1], generator=gen)
    x, residual = (torch.randn(shape, generator=gen) * 3 for _ in range(2))
    summed = x + residual
    expected = norm(summed)
    fused_x, fused_r = x.clone(), residual.clone()
    got, new_residual = norm(fused_x, fused_r)
    assert got is fused_x and new_residual is fused_r  # in place
    assert torch.equal(new_residual, summed) and torch.equal(got, expected)
    strided = torch.empty(*shape[:-1], 2 * shape[-1])[..., ::2]
    strided.copy_(x)
    got_strided, residual_strided = norm(strided, residual.clone())
    assert torch.equal(got_strided, expected) and torch.equal(residual_strided, summed)
    exact = formula(monkeypatch, lambda a, b: norm.double()(a, b)[0], x, residual)
    assert close(got, exact)


@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_fused_rotary_matches_formula_on_a_qkv_view(head_dim, gen, monkeypatch):
    tokens, heads = 7, 5
    qkv = torch.randn(tokens, heads + 2, head_dim, generator=gen)
    x = qkv[:, 1 : heads + 1]  # token stride != heads * head_dim
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = layers.apply_rotary(x, cos, sin)
    assert got.shape == x.shape
    assert close(got, formula(monkeypatch, layers.apply_rotary, x, cos, sin))


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (9, 2 * 40), (2, 3, 2 * 17)])
def test_fused_silu_and_mul_matches_formula(shape, gen, monkeypatch):
    gate_up = torch.randn(shape, generator=gen) * 4
    got = layers.silu_and_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert got.shape == gate.shape
    assert close(got, F.silu(gate) * up)
    assert close(got, formula(monkeypatch, layers.silu_and_mul, gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_gives_the_separate_ops_bits(dtype, gen, monkeypatch):
    """RMSNorm(h, residual) in one in-place C++ call equals the add (rounded to the dtype) and
    then rms_norm, bit for bit, and is the path taken for float32 and bf16."""
    ext = cpu_extension.load()
    calls = []
    fused = ext.add_rms_norm_
    monkeypatch.setattr(ext, "add_rms_norm_", lambda *a: calls.append(1) or fused(*a))
    norm = layers.RMSNorm(576, 1e-5).requires_grad_(False)
    norm.weight.data = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    h = (torch.randn(7, 576, generator=gen) * 3).to(dtype)
    residual = (torch.randn(7, 576, generator=gen) * 10).to(dtype)
    added = h + residual
    expected = ext.rms_norm(added, norm.weight, norm.eps)
    got, got_residual = norm(h.clone(), residual.clone())
    assert calls == [1]
    assert torch.equal(got_residual, added)
    assert torch.equal(got, expected)


def test_fused_ops_reject_other_dtypes_with_a_clear_error():
    ext = cpu_extension.load()
    with pytest.raises(ValueError, match="float32"):
        ext.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ext.rms_norm(torch.ones(2, 4), torch.ones(3), 1e-6)
    with pytest.raises(ValueError, match="cos"):
        ext.rotary(torch.ones(2, 1, 4), torch.ones(3, 4), torch.ones(3, 4))
    with pytest.raises(ValueError, match="even"):
        ext.silu_and_mul(torch.ones(2, 5))
    with pytest.raises(ValueError, match="one shape"):
        ext.add_rms_norm_(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        ext.add_rms_norm_(torch.ones(4, 2).t(), torch.ones(2, 4), torch.ones(4), 1e-6)


def test_fused_ops_take_empty_inputs():
    ext = cpu_extension.load()
    assert ext.rotary(torch.ones(3, 0, 4), torch.ones(3, 4), torch.ones(3, 4)).shape == (3, 0, 4)
    assert ext.rotary(torch.ones(0, 2, 4), torch.ones(0, 4), torch.ones(0, 4)).shape == (0, 2, 4)
    assert ext.silu_and_mul(torch.ones(0, 6)).shape == (0, 3)
    assert ext.rms_norm(torch.ones(0, 4), torch.ones(4), 1e-6).shape == (0, 4)
    ext.add_rms_norm_(torch.ones(0, 4), torch.ones(0, 4), torch.ones(4), 1e-6)


@pytest.mark.parametrize(("inter", "bias"), [(48, False), (36, False), (48, True)])
def test_swiglu_of_packed_projection_equals_projection_then_silu_and_mul(
    inter, bias, gen, monkeypatch
):
    """The fused gate_up GEMM + SwiGLU (intermediate a multiple of the SIMD width, no bias)
    gives the bits of the projection followed by silu_and_mul; other shapes take that path."""
    ext = cpu_extension.load()
    fused_calls = []
    fused = ext.linear_silu_mul
    monkeypatch.setattr(ext, "linear_silu_mul", lambda *a: fused_calls.append(1) or fused(*a))
    proj = linear.Linear(24, 2 * inter, bias=bias).requires_grad_(False)
    proj.weight.data = torch.randn(2 * inter, 24, generator=gen)
    if bias:
        proj.bias.data = torch.randn(2 * inter, generator=gen)
    gate, up = proj.weight.double().chunk(2)
    proj.prepack()
    gate_bias, up_bias = proj.bias.double().chunk(2) if bias else (None, None)
    shapes = [*((m, 24) for m in range(1, 10)), (300, 24), (2, 5, 24)]  # 1-9: one row tile
    for shape in shapes:
        x = torch.randn(shape, generator=gen)
        got = layers.swiglu(proj, x)
        assert got.shape == (*shape[:-1], inter)
        assert torch.equal(got, layers.silu_and_mul(proj(x)))
        # and both equal the plain PyTorch formula (float64 oracle), not merely each other
        x64 = x.double()
        exact = F.silu(F.linear(x64, gate, gate_bias)) * F.linear(x64, up, up_bias)
        assert close(got, exact, tol=1e-5), shape
    # every shape when fused (36: no multiple of the SIMD width, 8 or 16 floats)
    assert len(fused_calls) == (len(shapes) if inter == 48 and not bias else 0)


def test_swiglu_row_does_not_depend_on_how_many_rows_share_the_call(gen):
    """The fused gate_up GEMM's rows: one tile of all rows up to 8 (fewer panels per tile), or
    tiles of 6 or 2 and their parts; a row's bits are the same in each."""
    proj = linear.Linear(40, 2 * 48, bias=False).requires_grad_(False)
    proj.weight.data = torch.randn(2 * 48, 40, generator=gen)
    proj.prepack()
    x = torch.randn(300, 40, generator=gen)
    full = layers.swiglu(proj, x)
    for rows in (*range(1, 10), 13, 257):
        assert torch.equal(layers.swiglu(proj, x[:rows]), full[:rows]), rows
