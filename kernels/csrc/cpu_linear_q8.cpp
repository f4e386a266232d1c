// y = x W^T + b on the CPU for an int8 weight (GGUF Q8_0's numbers), float32 x, y and sums.
//
// Why our own: at one row (batch-1 decode, bound by reading the weights) torch's
// _weight_int8pack_mm ran 3x slower than the float32 GEMM (1.9x faster with bf16 activations,
// still 4x off what the bytes allow), oneDNN's int8 linear (qlinear_pointwise) needs int8
// activations and costs ~0.6 ms a call at one row, and torchao's wheel has no CPU kernel
// (README; python -m benchmarks.linear has the library columns).
//
// The weight [N, K] is Q8_0: per output row, blocks of kQ8Block along K, each an int8 vector q and
// one float16 scale d, w = d * q. The products run in integers, so that the int8 weights are
// multiplied as they are read instead of being converted to floats first (a conversion and a
// scale per weight made the float kernel compute-bound at ~12 GB/s):
// - each row of x is quantised per block of kQ8Block to int16: s = max|x| / 32767 and
//   xq = round(x / s) (to nearest even), an error of at most 1/65534 of the block's largest
//   value: finer than bf16 activations (1/256), and far finer than the weight's own int8;
// - each block's dot product sum(xq * q) is exact in int32 (VNNI's vpdpwssd where the build has
//   it, else madd + add: the same integers), and the float32 result accumulates
//   y += float(dot) * (d * s) block by block in k order, from the bias.
// Every output element is that one chain, so a row's bits do not depend on the number of rows,
// the tile, the thread count or the SIMD level.
//
// The pack: panels of V output columns (V floats to a vector), q as [N/V][Kp/2][V][2] int8 (Kp
// is K rounded up to a whole block, padding q = 0): one k pair of a panel is 2V bytes, widened
// to one vector of 2V int16; d as [N/V][Kp/kQ8Block][V] float16.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t kQ8Block = 32;  // GGUF's QK8_0
constexpr int64_t kPairs = kQ8Block / 2;
constexpr float kXMax = 32767.f;
// Tiles: R * P int32 and R * P float accumulators + P weight vectors stay in registers.
constexpr int kTileRows = V >= 16 ? 4 : 2;
constexpr int kTilePanels = 3;
constexpr int kGatedRows = V >= 16 ? 3 : 1;
constexpr int kGatedPanels = 2;
// Rows whose quantised activations are made and reused at a time (bounds the buffer).
constexpr int64_t kChunkRows = 256;

// Integer SIMD of the same width as Vec: one vector holds V int32 sums, or the 2V int16 of one
// k pair of a panel.
#if defined(CPU_CAPABILITY_AVX512)
using IVec = __m512i;
C10_ALWAYS_INLINE IVec izero() { return _mm512_setzero_si512(); }
C10_ALWAYS_INLINE IVec widen(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
C10_ALWAYS_INLINE IVec broadcast_pair(int32_t pair) { return _mm512_set1_epi32(pair); }
C10_ALWAYS_INLINE IVec dot_pairs(IVec acc, IVec x, IVec w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, x, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}
C10_ALWAYS_INLINE Vec to_float(IVec i) { return _mm512_cvtepi32_ps(i); }
C10_ALWAYS_INLINE Vec load_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(CPU_CAPABILITY_AVX2)
using IVec = __m256i;
C10_ALWAYS_INLINE IVec izero() { return _mm256_setzero_si256(); }
C10_ALWAYS_INLINE IVec widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
C10_ALWAYS_INLINE IVec broadcast_pair(int32_t pair) { return _mm256_set1_epi32(pair); }
C10_ALWAYS_INLINE IVec dot_pairs(IVec acc, IVec x, IVec w) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
}
C10_ALWAYS_INLINE Vec to_float(IVec i) { return _mm256_cvtepi32_ps(i); }
C10_ALWAYS_INLINE Vec load_scales(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
struct IVec {
  int32_t v[V];  // lane c: the int32 sum of column c; as widened weights, lanes of int16 pairs
  int16_t w[2 * V];
};
inline IVec izero() { return IVec{}; }
inline IVec widen(const int8_t* p) {
  IVec r{};
  for (int64_t c = 0; c < 2 * V; ++c) r.w[c] = p[c];
  return r;
}
inline IVec broadcast_pair(int32_t pair) {
  IVec r{};
  std::memcpy(r.w, &pair, sizeof(pair));  // the pair (x[2t], x[2t+1]) as int16 in w[0], w[1]
  return r;
}
inline IVec dot_pairs(IVec acc, IVec x, IVec w) {
  for (int64_t c = 0; c < V; ++c) acc.v[c] += x.w[0] * w.w[2 * c] + x.w[1] * w.w[2 * c + 1];
  return acc;
}
inline Vec to_float(IVec i) {
  float f[V];
  for (int64_t c = 0; c < V; ++c) f[c] = static_cast<float>(i.v[c]);
  return Vec::loadu(f);
}
inline Vec load_scales(const c10::Half* p) {
  float f[V];
  for (int64_t c = 0; c < V; ++c) f[c] = static_cast<float>(p[c]);
  return Vec::loadu(f);
}
#endif

// Rows of x quantised per block: xq [rows][Kp] int16 (k pairs read as one int32), s [rows][nb].
struct QuantRows {
  const int16_t* xq;
  const float* s;
  int64_t Kp, nb;
  C10_ALWAYS_INLINE int32_t pair(int64_t row, int64_t t) const {
    int32_t p;
    std::memcpy(&p, xq + row * Kp + 2 * t, sizeof(p));
    return p;
  }
};

// x [rows, K] float32 -> int16 per block (the file comment's rule), padding blocks with 0.
void quantize_rows(const float* x, int64_t rows, int64_t K, int16_t* xq, float* s, int64_t nb) {
  const int64_t Kp = nb * kQ8Block;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * K + b * kQ8Block;
        const int64_t n = std::min(kQ8Block, K - b * kQ8Block);
        float amax = 0.f;
        for (int64_t c = 0; c < n; ++c) amax = std::max(amax, std::fabs(xb[c]));
        const float inv = amax > 0.f ? kXMax / amax : 0.f;
        int16_t* qb = xq + r * Kp + b * kQ8Block;
        for (int64_t c = 0; c < n; ++c) qb[c] = static_cast<int16_t>(std::nearbyint(xb[c] * inv));
        for (int64_t c = n; c < kQ8Block; ++c) qb[c] = 0;
        s[r * nb + b] = amax / kXMax;
      }
    }
  });
}

// Weight panels of a group: panel j's k pair t at q + j * q_stride + t * 2V, its block b's
// scales at d + j * d_stride + b * V.
struct Q8Panels {
  const int8_t* q;
  const c10::Half* d;
  int64_t q_stride, d_stride;
  C10_ALWAYS_INLINE IVec weights(int64_t j, int64_t t) const {
    return widen(q + j * q_stride + t * 2 * V);
  }
  C10_ALWAYS_INLINE Vec scales(int64_t j, int64_t b) const {
    return load_scales(d + j * d_stride + b * V);
  }
};

// acc[i][j] += x[row + i] . (panel j) over all blocks, each block's integer dot product scaled
// into float32 in k order; panels.weights(j, t) / panels.scales(j, b) give panel j's data.
template <int R, int P, typename Panels>
C10_ALWAYS_INLINE void accumulate(const QuantRows& x, int64_t row, const Panels& panels,
                                  Vec (&acc)[R][P]) {
  for (int64_t b = 0; b < x.nb; ++b) {
    IVec dot[R][P];
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < P; ++j) dot[i][j] = izero();
    }
    for (int64_t t = b * kPairs; t < (b + 1) * kPairs; ++t) {
      IVec w[P];
      for (int j = 0; j < P; ++j) w[j] = panels.weights(j, t);
      for (int i = 0; i < R; ++i) {
        const IVec xi = broadcast_pair(x.pair(row + i, t));
        for (int j = 0; j < P; ++j) dot[i][j] = dot_pairs(dot[i][j], xi, w[j]);
      }
    }
    Vec d[P];
    for (int j = 0; j < P; ++j) d[j] = panels.scales(j, b);
    for (int i = 0; i < R; ++i) {
      const Vec s(x.s[(row + i) * x.nb + b]);
      for (int j = 0; j < P; ++j) acc[i][j] = at::vec::fmadd(to_float(dot[i][j]), d[j] * s, acc[i][j]);
    }
  }
}

// out = x . panels + bias for R rows and P panels; the last panel has last_cols real columns.
template <int R, int P, typename Panels>
void tile(const QuantRows& x, int64_t row, const Panels& panels, const float* bias, float* out,
          int64_t ldo, int64_t last_cols) {
  Vec acc[R][P];
  for (int j = 0; j < P; ++j) {
    const Vec init = bias ? Vec::loadu(bias + j * V, j == P - 1 ? last_cols : V) : Vec(0.f);
    for (int i = 0; i < R; ++i) acc[i][j] = init;
  }
  accumulate<R, P>(x, row, panels, acc);
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < P; ++j) acc[i][j].store(out + i * ldo + j * V, j == P - 1 ? last_cols : V);
  }
}

// silu(gate) * up: panels 0..P-1 are gate panels, P..2P-1 the matching up panels.
template <int R, int P, typename Panels>
void gated_tile(const QuantRows& x, int64_t row, const Panels& panels, float* out, int64_t ldo) {
  Vec acc[R][2 * P];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 2 * P; ++j) acc[i][j] = Vec(0.f);
  }
  accumulate<R, 2 * P>(x, row, panels, acc);
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < P; ++j) silu_mul(acc[i][j], acc[i][P + j]).store(out + i * ldo + j * V);
  }
}

// fn(std::integral_constant<int, R>, first row) over rows [0, M), as in cpu_linear.cpp.
template <int RMax, typename Fn>
void row_tiles(int64_t M, const Fn& fn) {
  int64_t i = 0;
  for (; i + RMax <= M; i += RMax) fn(std::integral_constant<int, RMax>{}, i);
  if constexpr (RMax > 2) {
    for (; i + 2 <= M; i += 2) fn(std::integral_constant<int, 2>{}, i);
  }
  for (; i < M; ++i) fn(std::integral_constant<int, 1>{}, i);
}

// fn(quantised rows, first row, rows, panels of the group, first panel, panel count) for chunks
// of kChunkRows rows (quantised once each) and groups of `per_group` panels split across
// threads; a thread's group is read from memory once per chunk and reused from cache by every
// row tile.
template <typename Fn>
void over_groups(const at::Tensor& x, const at::Tensor& pq, const at::Tensor& pd, int64_t panels,
                 int per_group, const Fn& fn) {
  const int64_t M = x.size(0), K = x.size(1), nb = pd.size(1), Kp = nb * kQ8Block;
  const Q8Panels all{pq.data_ptr<int8_t>(), pd.data_ptr<c10::Half>(), Kp * V, nb * V};
  const int64_t groups = (panels + per_group - 1) / per_group;
  const int64_t chunk = std::min(kChunkRows, M);
  std::vector<int16_t> xq(chunk * Kp);
  std::vector<float> s(chunk * nb);
  for (int64_t m = 0; m < M; m += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m);
    quantize_rows(x.data_ptr<float>() + m * K, rows, K, xq.data(), s.data(), nb);
    const QuantRows quant{xq.data(), s.data(), Kp, nb};
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * per_group;
        const int count = static_cast<int>(std::min<int64_t>(per_group, panels - first));
        const Q8Panels group{all.q + first * all.q_stride, all.d + first * all.d_stride,
                             all.q_stride, all.d_stride};
        fn(quant, m, rows, group, first, count);
      }
    });
  }
}

void check_packed_q8(const at::Tensor& x, const at::Tensor& pq, const at::Tensor& pd) {
  TORCH_CHECK_VALUE(pq.dim() == 4 && pq.size(2) == V && pq.size(3) == 2 &&
                        pq.scalar_type() == at::kChar && pq.is_contiguous() && pd.dim() == 3 &&
                        pd.size(0) == pq.size(0) && pd.size(1) * kPairs == pq.size(1) &&
                        pd.size(2) == V && pd.scalar_type() == at::kHalf && pd.is_contiguous(),
                    "packed weight and scales must come from pack_q8_weight on this CPU");
  const int64_t K = x.dim() == 2 ? x.size(1) : -1;
  TORCH_CHECK_VALUE(x.dim() == 2 && K > (pd.size(1) - 1) * kQ8Block &&
                        K <= pd.size(1) * kQ8Block && x.scalar_type() == at::kFloat &&
                        x.device().is_cpu(),
                    "x must be a float32 CPU tensor [rows, in_features] matching the packed "
                    "weight's ", pd.size(1), " blocks of ", kQ8Block, ", got ", x.sizes(), " ",
                    x.scalar_type());
}

}  // namespace

std::vector<at::Tensor> pack_q8_weight(const at::Tensor& qs, const at::Tensor& scales) {
  TORCH_CHECK_VALUE(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.device().is_cpu(),
                    "qs must be a 2-D int8 CPU tensor, got ", qs.sizes(), " ", qs.scalar_type());
  const int64_t N = qs.size(0), K = qs.size(1), nb = (K + kQ8Block - 1) / kQ8Block;
  TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == nb &&
                        (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                        scales.device().is_cpu(),
                    "scales must be float32 or float16 [", N, ", ", nb, "], got ", scales.sizes(),
                    " ", scales.scalar_type());
  const auto d16 = scales.to(at::kHalf).contiguous();
  TORCH_CHECK_VALUE(d16.to(scales.scalar_type()).equal(scales),
                    "scales must be float16 values (Q8_0 keeps d as float16)");
  const int64_t panels = (N + V - 1) / V;
  const auto q = qs.contiguous();
  auto pq = at::zeros({panels, nb * kPairs, V, 2}, q.options());  // padding: q = 0, d = 0
  auto pd = at::zeros({panels, nb, V}, d16.options());
  const int8_t* qsrc = q.data_ptr<int8_t>();
  const c10::Half* dsrc = d16.data_ptr<c10::Half>();
  int8_t* qdst = pq.data_ptr<int8_t>();
  c10::Half* ddst = pd.data_ptr<c10::Half>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < V && p * V + c < N; ++c) {
        const int64_t n = p * V + c;
        for (int64_t k = 0; k < K; ++k) qdst[((p * nb * kPairs + k / 2) * V + c) * 2 + k % 2] = qsrc[n * K + k];
        for (int64_t b = 0; b < nb; ++b) ddst[(p * nb + b) * V + c] = dsrc[n * nb + b];
      }
    }
  });
  return {pq, pd};
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& packed_q, const at::Tensor& packed_d,
                     const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_packed_q8(x, packed_q, packed_d);
  const int64_t N = out_features, panels = packed_q.size(0);
  TORCH_CHECK_VALUE(N > (panels - 1) * V && N <= panels * V, "out_features ", N,
                    " does not match the packed weight");
  const auto xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == N && b.scalar_type() == at::kFloat,
                      "bias must be float32 [", N, "]");
  }
  auto out = at::empty({xc.size(0), N}, xc.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  over_groups(xc, packed_q, packed_d, panels, kTilePanels,
              [&](const QuantRows& x, int64_t m, int64_t rows, const Q8Panels& group,
                  int64_t first, int count) {
                const int64_t last_cols = std::min(V, N - (first + count - 1) * V);
                const float* bias_cols = bp ? bp + first * V : nullptr;
                row_tiles<kTileRows>(rows, [&](auto tile_rows, int64_t i) {
                  constexpr int R = decltype(tile_rows)::value;
                  float* oi = op + (m + i) * N + first * V;
                  switch (count) {
                    case 1: return tile<R, 1>(x, i, group, bias_cols, oi, N, last_cols);
                    case 2: return tile<R, 2>(x, i, group, bias_cols, oi, N, last_cols);
                    default:
                      return tile<R, kTilePanels>(x, i, group, bias_cols, oi, N, last_cols);
                  }
                });
              });
  return out;
}

at::Tensor linear_silu_mul_q8(const at::Tensor& x, const at::Tensor& packed_q,
                              const at::Tensor& packed_d, int64_t intermediate) {
  check_packed_q8(x, packed_q, packed_d);
  const int64_t half = packed_q.size(0) / 2;
  TORCH_CHECK_VALUE(intermediate % V == 0 && packed_q.size(0) * V == 2 * intermediate,
                    "packed must be a gate_up weight of 2 * ", intermediate,
                    " rows, a multiple of ", V, " each");
  const auto xc = x.contiguous();
  auto out = at::empty({xc.size(0), intermediate}, xc.options());
  float* op = out.data_ptr<float>();
  over_groups(xc, packed_q, packed_d, half, kGatedPanels,
              [&](const QuantRows& x, int64_t m, int64_t rows, const Q8Panels& group,
                  int64_t first, int count) {
                row_tiles<kGatedRows>(rows, [&](auto tile_rows, int64_t i) {
                  constexpr int R = decltype(tile_rows)::value;
                  float* oi = op + (m + i) * intermediate + first * V;
                  // Gate panel j is the group's panel j; its up panel is `half` panels on.
                  const auto with_up = [&](auto p) {
                    constexpr int P = decltype(p)::value;
                    struct GateUp {
                      const Q8Panels& g;
                      int64_t half;
                      C10_ALWAYS_INLINE IVec weights(int64_t j, int64_t t) const {
                        return g.weights(j < P ? j : j - P + half, t);
                      }
                      C10_ALWAYS_INLINE Vec scales(int64_t j, int64_t b) const {
                        return g.scales(j < P ? j : j - P + half, b);
                      }
                    };
                    gated_tile<R, P>(x, i, GateUp{group, half}, oi, intermediate);
                  };
                  if (count < kGatedPanels) return with_up(std::integral_constant<int, 1>{});
                  return with_up(std::integral_constant<int, kGatedPanels>{});
                });
              });
  return out;
}
