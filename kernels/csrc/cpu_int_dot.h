// The integer-dot GEMM shared by the GGUF weight kernels (cpu_linear_q8.cpp: Q8_0,
// cpu_linear_q4.cpp: Q4_1): float32 x quantised per block of kBlock to int16, each block's dot
// product with the weight's integers exact in int32, the float32 result accumulated block by
// block in k order from the bias (cpu_linear_q8.cpp's file comment says why).
//
// A format supplies its Panels: V output columns of the packed weight at a time,
//   kStep                          k pairs one weights() call yields
//   weights(j, t, IVec (&w)[kStep]) panel j's int16 weights of k pairs t .. t + kStep - 1, one
//                                  vector of 2V int16 (V columns x the pair) each
//   scales(j, b)                   panel j's block-b scales (a Scales value)
//   apply(scales, dot, s, xsum, acc) acc + the block's float32 term, from its integer dot
//                                  product, the row's block scale s and sum(xq) of the block
//   group(first)                   the panels from panel `first` on
// and every output element is the same chain of block terms whatever the rows, tile, thread
// count or SIMD level, so a row's bits do not depend on the batch.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace int_dot {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t kBlock = 32;  // GGUF's QK8_0 and QK4_1
constexpr int64_t kPairs = kBlock / 2;
constexpr float kXMax = 32767.f;
// Tiles: R * P int32 and R * P float accumulators + the weight vectors stay in registers.
constexpr int kTileRows = V >= 16 ? 4 : 2;
constexpr int kTilePanels = 3;
constexpr int kGatedRows = V >= 16 ? 3 : 1;
constexpr int kGatedPanels = 2;
// Rows whose quantised activations are made and reused at a time (bounds the buffer).
constexpr int64_t kChunkRows = 256;
// Rows up to which a call quantises on one thread (over_groups).
constexpr int64_t kSerialQuantRows = 4;

// Integer SIMD of the same width as Vec: one vector holds V int32 sums, or the 2V int16 of one
// k pair of a panel.
#if defined(CPU_CAPABILITY_AVX512)
using IVec = __m512i;
C10_ALWAYS_INLINE IVec izero() { return _mm512_setzero_si512(); }
C10_ALWAYS_INLINE IVec widen(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 2V bytes -> (low nibbles, high nibbles), each 2V int16 in 0..15.
C10_ALWAYS_INLINE void widen_nibbles(const uint8_t* p, IVec& low, IVec& high) {
  const IVec b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  low = _mm512_and_si512(b, _mm512_set1_epi16(0x0F));
  high = _mm512_srli_epi16(b, 4);
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
// max|x| of a block of kBlock floats.
C10_ALWAYS_INLINE float block_amax(const float* x) {
  const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x)), b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
  return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}
// q = round(x * inv) for a block (to nearest even: MXCSR's default mode, as std::nearbyint's);
// returns sum(q). |x * inv| <= 32767 (inv = kXMax / max|x|), so the int16 narrowing is exact.
C10_ALWAYS_INLINE int32_t quantize_block(const float* x, float inv, int16_t* q) {
  const __m512 scale = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), scale));
  const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), scale));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtsepi32_epi16(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtsepi32_epi16(hi));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
}
#elif defined(CPU_CAPABILITY_AVX2)
using IVec = __m256i;
C10_ALWAYS_INLINE IVec izero() { return _mm256_setzero_si256(); }
C10_ALWAYS_INLINE IVec widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
C10_ALWAYS_INLINE void widen_nibbles(const uint8_t* p, IVec& low, IVec& high) {
  const IVec b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
  high = _mm256_srli_epi16(b, 4);
}
C10_ALWAYS_INLINE IVec broadcast_pair(int32_t pair) { return _mm256_set1_epi32(pair); }
C10_ALWAYS_INLINE IVec dot_pairs(IVec acc, IVec x, IVec w) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
}
C10_ALWAYS_INLINE Vec to_float(IVec i) { return _mm256_cvtepi32_ps(i); }
C10_ALWAYS_INLINE Vec load_scales(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
C10_ALWAYS_INLINE float block_amax(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
  for (int i = 8; i < kBlock; i += 8) {
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
C10_ALWAYS_INLINE int32_t quantize_block(const float* x, float inv, int16_t* q) {
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < kBlock; i += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), scale));
    // packs works per 128-bit lane (a0-3 b0-3 a4-7 b4-7): the permute restores the order
    const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), ab);
    sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
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
inline void widen_nibbles(const uint8_t* p, IVec& low, IVec& high) {
  low = high = IVec{};
  for (int64_t c = 0; c < 2 * V; ++c) {
    low.w[c] = p[c] & 0x0F;
    high.w[c] = p[c] >> 4;
  }
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
inline float block_amax(const float* x) {
  float amax = 0.f;
  for (int64_t c = 0; c < kBlock; ++c) amax = std::max(amax, std::fabs(x[c]));
  return amax;
}
inline int32_t quantize_block(const float* x, float inv, int16_t* q) {
  int32_t total = 0;
  for (int64_t c = 0; c < kBlock; ++c) {
    q[c] = static_cast<int16_t>(std::nearbyint(x[c] * inv));
    total += q[c];
  }
  return total;
}
#endif

// Rows of x quantised per block: xq [rows][Kp] int16 (k pairs read as one int32), s [rows][nb]
// the block scales, sum [rows][nb] each block's sum(xq) (exact in float: below 2^21).
struct QuantRows {
  const int16_t* xq;
  const float* s;
  const float* sum;
  int64_t Kp, nb;
  C10_ALWAYS_INLINE int32_t pair(int64_t row, int64_t t) const {
    int32_t p;
    std::memcpy(&p, xq + row * Kp + 2 * t, sizeof(p));
    return p;
  }
};

// A row x [K] float32 -> int16 per block: s = max|x| / 32767 and xq = round(x / s) (to nearest
// even), padding blocks with 0 (a last partial block is quantised from a zero-padded copy).
inline void quantize_row(const float* x, int64_t K, int16_t* xq, float* s, float* sum,
                         int64_t nb) {
  float padded[kBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kBlock;
    const int64_t n = std::min(kBlock, K - b * kBlock);
    if (n < kBlock) {
      std::fill(std::copy(xb, xb + n, padded), padded + kBlock, 0.f);
      xb = padded;
    }
    const float amax = block_amax(xb), quotient = kXMax / amax;
    // q = 0 where the quotient is not finite: an all-zero block, or one so small
    // (max|x| < 32767 / FLT_MAX) that it overflows (x * inf would not convert to an integer)
    const float inv = std::isfinite(quotient) ? quotient : 0.f;
    sum[b] = static_cast<float>(quantize_block(xb, inv, xq + b * kBlock));
    s[b] = amax / kXMax;
  }
}

// acc[i][j] += x[row + i] . (panel j) over all blocks, each block's integer dot product scaled
// into float32 in k order.
template <int R, int P, typename Panels>
C10_ALWAYS_INLINE void accumulate(const QuantRows& x, int64_t row, const Panels& panels,
                                  Vec (&acc)[R][P]) {
  constexpr int S = Panels::kStep;
  for (int64_t b = 0; b < x.nb; ++b) {
    IVec dot[R][P];
    for (int i = 0; i < R; ++i) {
      for (int j = 0; j < P; ++j) dot[i][j] = izero();
    }
    for (int64_t t = b * kPairs; t < (b + 1) * kPairs; t += S) {
      IVec w[P][S];
      for (int j = 0; j < P; ++j) panels.weights(j, t, w[j]);
      for (int u = 0; u < S; ++u) {
        for (int i = 0; i < R; ++i) {
          const IVec xi = broadcast_pair(x.pair(row + i, t + u));
          for (int j = 0; j < P; ++j) dot[i][j] = dot_pairs(dot[i][j], xi, w[j][u]);
        }
      }
    }
    typename Panels::Scales scales[P];
    for (int j = 0; j < P; ++j) scales[j] = panels.scales(j, b);
    for (int i = 0; i < R; ++i) {
      const Vec s(x.s[(row + i) * x.nb + b]), xsum(x.sum[(row + i) * x.nb + b]);
      for (int j = 0; j < P; ++j) {
        acc[i][j] = Panels::apply(scales[j], to_float(dot[i][j]), s, xsum, acc[i][j]);
      }
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

// Gate panel j (< P) of a group is its panel j, its up panel the one `half` panels on.
template <typename Panels, int P>
struct GateUp {
  static constexpr int kStep = Panels::kStep;
  using Scales = typename Panels::Scales;
  const Panels& g;
  int64_t half;
  C10_ALWAYS_INLINE int64_t at(int64_t j) const { return j < P ? j : j - P + half; }
  C10_ALWAYS_INLINE void weights(int64_t j, int64_t t, IVec (&w)[kStep]) const {
    g.weights(at(j), t, w);
  }
  C10_ALWAYS_INLINE Scales scales(int64_t j, int64_t b) const { return g.scales(at(j), b); }
  C10_ALWAYS_INLINE static Vec apply(const Scales& sc, Vec dot, Vec s, Vec xsum, Vec acc) {
    return Panels::apply(sc, dot, s, xsum, acc);
  }
};

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

// fn(quantised rows, first row, rows, panels of the group, first panel, panel count) for chunks
// of kChunkRows rows (quantised once each) and groups of `per_group` panels split across
// threads; a thread's group is read from memory once per chunk and reused from cache by every
// row tile.
template <typename Panels, typename Fn>
void over_groups(const at::Tensor& x, const Panels& all, int64_t nb, int64_t panels,
                 int per_group, const Fn& fn) {
  const int64_t M = x.size(0), K = x.size(1), Kp = nb * kBlock;
  const int64_t groups = (panels + per_group - 1) / per_group;
  const int64_t chunk = std::min(kChunkRows, M);
  // uninitialised (a vector would zero them every call): quantize_row writes every entry the
  // tiles read
  const std::unique_ptr<int16_t[]> xq(new int16_t[chunk * Kp]);
  const std::unique_ptr<float[]> s(new float[chunk * nb]), sum(new float[chunk * nb]);
  const float* xp = x.data_ptr<float>();
  const auto quantize = [&](int64_t m, int64_t r) {
    quantize_row(xp + (m + r) * K, K, xq.get() + r * Kp, s.get() + r * nb, sum.get() + r * nb, nb);
  };
  // One parallel region per call: the threads quantise a chunk's rows, meet at the barrier
  // that ends the `omp for`, then take the groups in contiguous, near-equal blocks. Quantising
  // on one thread while the others waited cost ~4% of a batch-32 decode step, and a region per
  // phase a fork and join each. Up to kSerialQuantRows rows (one chunk) are quantised before
  // the region: there the barrier costs more than it saves.
  const bool quantized = M <= kSerialQuantRows;
  for (int64_t r = 0; quantized && r < M; ++r) quantize(0, r);
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    for (int64_t m = 0; m < M; m += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, M - m);
      if (!quantized) {  // the same on every thread, so every thread meets this `omp for`
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) quantize(m, r);
      }
      const QuantRows quant{xq.get(), s.get(), sum.get(), Kp, nb};
#pragma omp for schedule(static) nowait
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * per_group;
        const int count = static_cast<int>(std::min<int64_t>(per_group, panels - first));
        fn(quant, m, rows, all.group(first), first, count);
      }
      if (m + kChunkRows < M) {  // the next chunk's quantisation must not overwrite rows in use
#pragma omp barrier
      }
    }
  }
}

// ValueError unless x is a float32 CPU [rows, K] with K in the pack's nb blocks.
inline void check_x(const at::Tensor& x, int64_t nb) {
  const int64_t K = x.dim() == 2 ? x.size(1) : -1;
  TORCH_CHECK_VALUE(x.dim() == 2 && K > (nb - 1) * kBlock && K <= nb * kBlock &&
                        x.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "x must be a float32 CPU tensor [rows, in_features] matching the packed "
                    "weight's ", nb, " blocks of ", kBlock, ", got ", x.sizes(), " ",
                    x.scalar_type());
}

// x [M, K] . panels^T + bias -> [M, N] (x checked by the caller; `panels` panels of V columns).
template <typename Panels>
at::Tensor linear(const at::Tensor& x, const Panels& all, int64_t nb, int64_t panels,
                  const c10::optional<at::Tensor>& bias, int64_t N) {
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
  // Groups of P panels, each over the call's row tiles (by_row_count): a tile holds an int32
  // and a float32 sum per (row, panel) and kStep weight vectors per panel.
  auto run = [&](auto panels_per_group, const auto& tiles) {
    constexpr int P = decltype(panels_per_group)::value;
    over_groups(xc, all, nb, panels, P,
                [&](const QuantRows& x, int64_t m, int64_t rows, const Panels& group,
                    int64_t first, int count) {
                  const int64_t last_cols = std::min(V, N - (first + count - 1) * V);
                  const float* bias_cols = bp ? bp + first * V : nullptr;
                  tiles(rows, [&](auto tile_rows, int64_t i) {
                    constexpr int R = decltype(tile_rows)::value;
                    float* oi = op + (m + i) * N + first * V;
                    if constexpr (P >= 3) {
                      if (count == 2) return tile<R, 2>(x, i, group, bias_cols, oi, N, last_cols);
                    }
                    if constexpr (P >= 2) {
                      if (count == 1) return tile<R, 1>(x, i, group, bias_cols, oi, N, last_cols);
                    }
                    tile<R, P>(x, i, group, bias_cols, oi, N, last_cols);
                  });
                });
  };
  by_row_count<2, Panels::kStep, kTilePanels, kTileRows, false>(xc.size(0), run);
  return out;
}

// silu(gate) * up of x . panels^T for `panels` = 2 * intermediate / V gate_up panels.
template <typename Panels>
at::Tensor linear_silu_mul(const at::Tensor& x, const Panels& all, int64_t nb, int64_t panels,
                           int64_t intermediate) {
  TORCH_CHECK_VALUE(intermediate % V == 0 && panels * V == 2 * intermediate,
                    "packed must be a gate_up weight of 2 * ", intermediate,
                    " rows, a multiple of ", V, " each");
  const int64_t half = panels / 2;
  const auto xc = x.contiguous();
  auto out = at::empty({xc.size(0), intermediate}, xc.options());
  float* op = out.data_ptr<float>();
  // A tile holds a gate and an up sum, each int32 and float32, per (row, panel), and kStep
  // weight vectors per gate and per up panel.
  auto run = [&](auto panels_per_group, const auto& tiles) {
    constexpr int P = decltype(panels_per_group)::value;
    over_groups(xc, all, nb, half, P,
                [&](const QuantRows& x, int64_t m, int64_t rows, const Panels& group,
                    int64_t first, int count) {
                  tiles(rows, [&](auto tile_rows, int64_t i) {
                    constexpr int R = decltype(tile_rows)::value;
                    float* oi = op + (m + i) * intermediate + first * V;
                    if constexpr (P >= 2) {
                      if (count == 1) {  // the last group of an odd number of panels
                        return gated_tile<R, 1>(x, i, GateUp<Panels, 1>{group, half}, oi,
                                                intermediate);
                      }
                    }
                    gated_tile<R, P>(x, i, GateUp<Panels, P>{group, half}, oi, intermediate);
                  });
                });
  };
  by_row_count<4, 2 * Panels::kStep, kGatedPanels, kGatedRows, false>(xc.size(0), run);
  return out;
}

}  // namespace int_dot
