// Fused float32 elementwise ops of a decoder layer, for the CPU.
//
// In PyTorch, RMSNorm is six ops, rotate-half rope five and SwiGLU's activation two; at decode
// each op touches a few KiB, so its dispatch, allocation and thread hand-off cost more than its
// arithmetic (about a fifth of a batch-32 decode step on the 2-core dev CPU). Each op here is one
// pass over rows, split across threads only when there are enough rows to pay for it.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>

#include "cpu_kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElements = 32768;  // ATen's grain for elementwise ops

int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

void check_float32(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.device().is_cpu(), name,
                    " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// out = weight * x / sqrt(mean(x^2) + eps) for one row of dim floats (out may be x).
void normalize_row(const float* x, const float* weight, double eps, int64_t dim, float* out) {
  const float sum_sq = at::vec::map_reduce_all<float>(
      [](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, x, dim);
  const float mean_sq = sum_sq / static_cast<float>(dim);
  const float inv_rms = 1.f / std::sqrt(mean_sq + static_cast<float>(eps));
  // HF rounds x * inv_rms before the weight multiplies it.
  at::vec::map2([inv_rms](Vec v, Vec g) { return g * (v * Vec(inv_rms)); }, out, x, weight, dim);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float32(x, "x");
  check_float32(weight, "weight");
  const int64_t dim = x.size(-1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == dim, "weight must be [", dim, "], got ",
                    weight.sizes());
  const auto rows = x.reshape({-1, dim}).contiguous();
  const auto w = weight.contiguous();
  auto out = at::empty_like(rows);
  const float* src = rows.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows.size(0), grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) normalize_row(src + i * dim, wp, eps, dim, dst + i * dim);
  });
  return out.view(x.sizes());
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float32(x, "x");
  check_float32(residual, "residual");
  check_float32(weight, "weight");
  const int64_t dim = x.size(-1);
  TORCH_CHECK_VALUE(x.sizes() == residual.sizes() && x.is_contiguous() && residual.is_contiguous(),
                    "x and residual must be contiguous and of one shape, got ", x.sizes(), " and ",
                    residual.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == dim, "weight must be [", dim, "], got ",
                    weight.sizes());
  const auto w = weight.contiguous();
  const float* wp = w.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  at::parallel_for(0, x.numel() / std::max<int64_t>(1, dim), grain(dim), [&](int64_t begin,
                                                                            int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* ri = rp + i * dim;
      float* xi = xp + i * dim;
      // residual + x rounds as the separate add would; the norm is rms_norm's on that sum.
      at::vec::map2([](Vec r, Vec v) { return r + v; }, ri, ri, xi, dim);
      normalize_row(ri, wp, eps, dim, xi);
    }
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float32(x, "x");
  check_float32(cos, "cos");
  check_float32(sin, "sin");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with D contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK_VALUE(dim % 2 == 0, "head dim must be even, got ", dim);
  TORCH_CHECK_VALUE(cos.sizes() == at::IntArrayRef({tokens, dim}) && sin.sizes() == cos.sizes(),
                    "cos and sin must be [", tokens, ", ", dim, "]");
  const auto c = cos.contiguous(), s = sin.contiguous();
  auto out = at::empty({tokens, heads, dim}, x.options());
  const float* src = x.data_ptr<float>();
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *ct = cp + t * dim, *st = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = src + t * token_stride + h * head_stride;
        float* oh = dst + (t * heads + h) * dim;
        // First half: x1 * cos1 - x2 * sin1; second half: x2 * cos2 + x1 * sin2.
        int64_t d = 0;
        for (; d + Vec::size() <= half; d += Vec::size()) {
          const Vec x1 = Vec::loadu(xh + d), x2 = Vec::loadu(xh + half + d);
          (x1 * Vec::loadu(ct + d) - x2 * Vec::loadu(st + d)).store(oh + d);
          (x2 * Vec::loadu(ct + half + d) + x1 * Vec::loadu(st + half + d)).store(oh + half + d);
        }
        for (; d < half; ++d) {
          const float x1 = xh[d], x2 = xh[half + d];
          oh[d] = x1 * ct[d] - x2 * st[d];
          oh[half + d] = x2 * ct[half + d] + x1 * st[half + d];
        }
      }
    }
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_float32(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1), inter = width / 2;
  TORCH_CHECK_VALUE(width % 2 == 0, "gate_up's last dim must be even, got ", width);
  const auto rows = gate_up.reshape({-1, width}).contiguous();
  auto out = at::empty({rows.size(0), inter}, rows.options());
  const float* src = rows.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows.size(0), grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* g = src + i * width;
      at::vec::map2([](Vec gv, Vec uv) { return silu_mul(gv, uv); }, dst + i * inter, g,
                    g + inter, inter);
    }
  });
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  return out.view(sizes);
}
