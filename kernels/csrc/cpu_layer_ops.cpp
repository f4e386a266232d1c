// Fused elementwise ops of a decoder layer, for the CPU, in float32 or bfloat16 (computed in
// float32 per row, rounded to bf16 once, or where HF rounds, as HF does).
//
// In PyTorch, RMSNorm is six ops, rotate-half rope five and SwiGLU's activation two; at decode
// each op touches a few KiB, so its dispatch, allocation and thread hand-off cost more than its
// arithmetic (about a fifth of a batch-32 decode step on the 2-core dev CPU). Each op here is one
// pass over rows, split across threads only when there are enough rows to pay for it.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElements = 32768;  // ATen's grain for elementwise ops

int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// The dtype of every tensor of one call: float32 or bfloat16, the same for all.
at::ScalarType common_dtype(std::initializer_list<std::pair<const at::Tensor*, const char*>> ts) {
  const auto dtype = ts.begin()->first->scalar_type();
  for (const auto& [t, name] : ts) {
    TORCH_CHECK_VALUE((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                          t->scalar_type() == dtype && t->device().is_cpu(),
                      name, " must be a float32 or bfloat16 CPU tensor (all of one dtype), got ",
                      t->scalar_type(), " on ", t->device());
  }
  return dtype;
}

// n values of a float32 row as float32: the row itself; of a bf16 row: converted into buf.
template <typename T>
const float* as_float(const T* src, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    buf.resize(n);
    at::vec::convert(src, buf.data(), n);
    return buf.data();
  }
}

// Where a row's float32 results go before store_row: the output row itself, or buf.
template <typename T>
float* out_row(T* dst, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    buf.resize(n);
    return buf.data();
  }
}

// Round a bf16 row's float32 results into it (nearest even); nothing to do for float32.
template <typename T>
void store_row(const float* values, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) at::vec::convert(values, dst, n);
}

template <typename T>
void rms_norm_rows(const T* src, const T* weight, T* dst, int64_t rows, int64_t dim, float eps) {
  std::vector<float> wbuf;
  const float* wp = as_float(weight, dim, wbuf);
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> xbuf, obuf;
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = as_float(src + i * dim, dim, xbuf);
      float* oi = out_row(dst + i * dim, dim, obuf);
      const float sum_sq = at::vec::map_reduce_all<float>(
          [](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, xi, dim);
      const float mean_sq = sum_sq / static_cast<float>(dim);
      const float inv_rms = 1.f / std::sqrt(mean_sq + eps);
      // HF rounds x * inv_rms (to the input dtype) before the weight multiplies it.
      if constexpr (std::is_same_v<T, float>) {
        at::vec::map2([inv_rms](Vec v, Vec g) { return g * (v * Vec(inv_rms)); }, oi, xi, wp, dim);
      } else {
        at::vec::map([inv_rms](Vec v) { return v * Vec(inv_rms); }, oi, xi, dim);
        store_row(oi, dst + i * dim, dim);
        as_float(dst + i * dim, dim, xbuf);
        at::vec::map2([](Vec v, Vec g) { return g * v; }, oi, xbuf.data(), wp, dim);
      }
      store_row(oi, dst + i * dim, dim);
    }
  });
}

// out = weight * x / sqrt(mean(x^2) + eps) for one float32 row of dim (out may be x): the same
// bits as rms_norm_rows<float>.
void normalize_row(const float* x, const float* weight, float eps, int64_t dim, float* out) {
  const float sum_sq = at::vec::map_reduce_all<float>(
      [](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, x, dim);
  const float mean_sq = sum_sq / static_cast<float>(dim);
  const float inv_rms = 1.f / std::sqrt(mean_sq + eps);
  // HF rounds x * inv_rms before the weight multiplies it.
  at::vec::map2([inv_rms](Vec v, Vec g) { return g * (v * Vec(inv_rms)); }, out, x, weight, dim);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = common_dtype({{&x, "x"}, {&weight, "weight"}});
  const int64_t dim = x.size(-1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == dim, "weight must be [", dim, "], got ",
                    weight.sizes());
  const auto rows = x.reshape({-1, dim}).contiguous();
  const auto w = weight.contiguous();
  auto out = at::empty_like(rows);
  const auto e = static_cast<float>(eps);
  if (dtype == at::kFloat) {
    rms_norm_rows(rows.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(),
                  rows.size(0), dim, e);
  } else {
    rms_norm_rows(rows.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), rows.size(0), dim, e);
  }
  return out.view(x.sizes());
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const auto dtype = common_dtype({{&x, "x"}, {&residual, "residual"}, {&weight, "weight"}});
  const int64_t dim = x.size(-1);
  TORCH_CHECK_VALUE(x.sizes() == residual.sizes() && x.is_contiguous() && residual.is_contiguous(),
                    "x and residual must be contiguous and of one shape, got ", x.sizes(), " and ",
                    residual.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == dim, "weight must be [", dim, "], got ",
                    weight.sizes());
  const auto w = weight.contiguous();
  const auto e = static_cast<float>(eps);
  const int64_t rows = x.numel() / std::max<int64_t>(1, dim);
  if (dtype == at::kBFloat16) {
    // residual + x rounded to bf16 as the separate add rounds it, then rms_norm's rows into x.
    auto* rp = residual.data_ptr<at::BFloat16>();
    const auto* xp = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
      std::vector<float> rbuf, xbuf, sum(dim);
      for (int64_t i = begin; i < end; ++i) {
        const float* ri = as_float(rp + i * dim, dim, rbuf);
        const float* xi = as_float(xp + i * dim, dim, xbuf);
        at::vec::map2([](Vec r, Vec v) { return r + v; }, sum.data(), ri, xi, dim);
        store_row(sum.data(), rp + i * dim, dim);
      }
    });
    rms_norm_rows(rp, w.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), rows, dim, e);
    return;
  }
  const float* wp = w.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* ri = rp + i * dim;
      float* xi = xp + i * dim;
      // residual + x rounds as the separate add would; the norm is rms_norm's on that sum.
      at::vec::map2([](Vec r, Vec v) { return r + v; }, ri, ri, xi, dim);
      normalize_row(ri, wp, e, dim, xi);
    }
  });
}

namespace {

template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const T* src = x.data_ptr<T>();
  const T *cp = c.data_ptr<T>(), *sp = s.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> cbuf, sbuf, xbuf, obuf;
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = as_float(cp + t * dim, dim, cbuf);
      const float* st = as_float(sp + t * dim, dim, sbuf);
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = as_float(src + t * token_stride + h * head_stride, dim, xbuf);
        T* dh = dst + (t * heads + h) * dim;
        float* oh = out_row(dh, dim, obuf);
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
        store_row(oh, dh, dim);
      }
    }
  });
}

}  // namespace

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = common_dtype({{&x, "x"}, {&cos, "cos"}, {&sin, "sin"}});
  TORCH_CHECK_VALUE(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with D contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK_VALUE(dim % 2 == 0, "head dim must be even, got ", dim);
  TORCH_CHECK_VALUE(cos.sizes() == at::IntArrayRef({tokens, dim}) && sin.sizes() == cos.sizes(),
                    "cos and sin must be [", tokens, ", ", dim, "]");
  const auto c = cos.contiguous(), s = sin.contiguous();
  auto out = at::empty({tokens, heads, dim}, x.options());
  if (dtype == at::kFloat) {
    rotary_rows<float>(x, c, s, out);
  } else {
    rotary_rows<at::BFloat16>(x, c, s, out);
  }
  return out;
}

namespace {

template <typename T>
void silu_and_mul_rows(const T* src, T* dst, int64_t rows, int64_t inter) {
  const int64_t width = 2 * inter;
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> gbuf, obuf;
    for (int64_t i = begin; i < end; ++i) {
      const float* g = as_float(src + i * width, width, gbuf);
      float* o = out_row(dst + i * inter, inter, obuf);
      at::vec::map2([](Vec gv, Vec uv) { return silu_mul(gv, uv); }, o, g, g + inter, inter);
      store_row(o, dst + i * inter, inter);
    }
  });
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const auto dtype = common_dtype({{&gate_up, "gate_up"}});
  const int64_t width = gate_up.size(-1), inter = width / 2;
  TORCH_CHECK_VALUE(width % 2 == 0, "gate_up's last dim must be even, got ", width);
  const auto rows = gate_up.reshape({-1, width}).contiguous();
  auto out = at::empty({rows.size(0), inter}, rows.options());
  if (dtype == at::kFloat) {
    silu_and_mul_rows(rows.data_ptr<float>(), out.data_ptr<float>(), rows.size(0), inter);
  } else {
    silu_and_mul_rows(rows.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows.size(0),
                      inter);
  }
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  return out.view(sizes);
}
