// y = x W^T + b on the CPU for a bfloat16 weight packed once (pack_linear_weight_bf16), summed
// in float32.
//
// Batch-1 decode reads every weight once per token, so it runs at memory bandwidth: bf16 halves
// the bytes of fp32. On SmolLM2-135M's shapes (python -m benchmarks.linear, bf16 columns) this
// kernel ran 2.2-2.6x oneDNN's bf16 F.linear and 1.7x its prepacked GEMM at 1-2 rows, at ~0.85x
// the fp32 kernel's bandwidth, and level with both at 256-512 rows (a contended 2-core Zen 4).
// The weight [N, K] is packed into panels of kCols = 16 output columns with k in pairs,
// [ceil(N/16)][ceil(K/2)][16][2] (K padded with a zero column when odd), so that one k pair of
// a panel is one 64-byte line: one AVX512-BF16 vdpbf16ps
// (acc[c] += w[c][2k] x[2k] + w[c][2k+1] x[2k+1]) per line and tile row, or, where the CPU or
// the build lacks it, the same line widened to float32 by 16-bit shifts and two FMAs (any SIMD
// level: at::vec). The layout does not depend on the SIMD level. A tile of R rows by Q panels
// keeps its sums in registers across all of K; tiles split across threads by panels, rows go in
// chunks of kChunkRows. Each output element is summed over k in order: its value does not
// depend on the row count, the tiling or the thread count (for a given path).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;
constexpr int64_t V = Vec::size();
constexpr int64_t kCols = 16;          // output columns per panel, whatever the SIMD level
constexpr int64_t kLine = 2 * kCols;   // bf16 values per k pair of a panel (64 bytes)
// Panels per tile: 4 for the plain product, 2 up to kFewRows rows (twice the groups, so that 2
// threads split layers of 36 or 60 panels (SmolLM2's) evenly, where groups of 4 leave one
// thread a group more), and 2 gate + 2 up panels for the gated product. On AVX2 the widening
// path wants rows more than panels (below), so there the plain tiles take 1 panel.
constexpr int kPanels = V >= 16 ? 4 : 1;
constexpr int64_t kFewRows = 4;
constexpr int kFewRowsPanels = 2;
constexpr int kGatedPanels = 2;  // gate panels per tile (and as many up panels)
// On AVX2, past kFewRows rows, the gated product runs as tiles of 1 gate panel and tiles of 1
// up panel (4 rows each: a joint tile held 2 rows and spilled); up to kFewRows rows, where the
// weights stream from memory, the joint tiles of 2 + 2 panels keep more loads in flight (the
// split tiles took 1.3x their time at 1 row on a Zen 3).
constexpr bool kSplitGated = V < 16;
constexpr int64_t kChunkRows = 256;
// Most rows per tile. Registers: R * 4 accumulators + 4 weight lines (dot: 6 x 4 of 32 zmm).
constexpr int kDotRows = 6;
// Widening costs a shift and a mask per weight vector, shared by the R rows of a tile: with one
// row a tile spends as many integer ops as FMAs (bf16 ran at 0.85x the fp32 kernel's FLOP/s at
// 32 rows on a Zen 3). So a tile takes up to 4 rows, as many as kWidenSums accumulators hold
// (Q panels of kCols / V vectors per row), leaving room for the widened pair and broadcasts.
constexpr int kWidenSums = V >= 16 ? 16 : 8;
template <int Q>
constexpr int widen_rows() {
  constexpr int fit = kWidenSums / (Q * (kCols / V));
  return fit < 1 ? 1 : (fit > 4 ? 4 : fit);
}

// The path the products run: vdpbf16ps on bf16 x pairs, or bf16 -> float32 shifts and FMAs.
enum class Path { kDot, kWiden };

// The rows of x as the path reads them: bf16 pairs (one uint32 per k pair) or float32 with K
// padded to even. ld: the row stride in pairs (kDot) or floats (kWiden).
struct Rows {
  const uint32_t* pairs = nullptr;
  const float* floats = nullptr;
  int64_t ld = 0;
};

// ---- the widening path: any SIMD level (at::vec) ----

// out[i][j * 16 + c] = sum_k x[i][k] w_j[c][k] for R rows and Q panels.
template <int R, int Q>
void accumulate_widen(const float* x, int64_t ldx, const uint16_t* const (&panels)[Q], int64_t K2,
                      float (&out)[R][Q * kCols]) {
  constexpr int S = kCols / V;  // vectors per panel (1 on AVX512, 2 on AVX2)
  Vec acc[R][Q][S];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < Q; ++j) {
      for (int s = 0; s < S; ++s) acc[i][j][s] = Vec(0.f);
    }
  }
  const IVec shift(16), high(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = 0; k < K2; ++k) {
    for (int j = 0; j < Q; ++j) {
      if constexpr (S == 1 || R == 1) {
        for (int s = 0; s < S; ++s) {
          // V lanes of (w[c][2k], w[c][2k+1]): the low half is the even k (little endian).
          const IVec w = IVec::loadu(panels[j] + k * kLine + s * 2 * V);
          const Vec even = at::vec::cast<float>(w << shift), odd = at::vec::cast<float>(w & high);
          for (int i = 0; i < R; ++i) {
            const float* xi = x + i * ldx + 2 * k;
            acc[i][j][s] = at::vec::fmadd(Vec(xi[1]), odd, at::vec::fmadd(Vec(xi[0]), even,
                                                                           acc[i][j][s]));
          }
        }
      } else {
        // The panel's S vectors widened first, then each row's two broadcasts over them: GCC
        // then keeps 4 rows x 1 panel (8 sums) in AVX2's 16 registers. Widening per vector, as
        // the branch above does, GCC kept every row's broadcasts live and spilled sums: the
        // model's linears at 32 rows took 114 ms against 61 ms this way on a Zen 3.
        Vec even[S], odd[S];
        for (int s = 0; s < S; ++s) {
          const IVec w = IVec::loadu(panels[j] + k * kLine + s * 2 * V);
          even[s] = at::vec::cast<float>(w << shift);
          odd[s] = at::vec::cast<float>(w & high);
        }
        for (int i = 0; i < R; ++i) {
          const Vec x_even(x[i * ldx + 2 * k]), x_odd(x[i * ldx + 2 * k + 1]);
          for (int s = 0; s < S; ++s) {
            acc[i][j][s] = at::vec::fmadd(x_odd, odd[s], at::vec::fmadd(x_even, even[s],
                                                                        acc[i][j][s]));
          }
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < Q; ++j) {
      for (int s = 0; s < S; ++s) acc[i][j][s].store(out[i] + j * kCols + s * V);
    }
  }
}

// ---- the dot path: AVX512-BF16, compiled into AVX512 builds and run where the CPU has it ----

#if defined(CPU_CAPABILITY_AVX512)
#define PAGEDSPEC_HAS_DOT 1

template <int R, int Q>
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) void accumulate_dot(
    const uint32_t* x, int64_t ldx, const uint16_t* const (&panels)[Q], int64_t K2,
    float (&out)[R][Q * kCols]) {
  __m512 acc[R][Q];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < Q; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K2; ++k) {
    __m512i w[Q];
    for (int j = 0; j < Q; ++j) w[j] = _mm512_loadu_si512(panels[j] + k * kLine);
    for (int i = 0; i < R; ++i) {
      const __m512i xi = _mm512_set1_epi32(static_cast<int>(x[i * ldx + k]));
      for (int j = 0; j < Q; ++j) {
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)w[j], (__m512bh)xi);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < Q; ++j) _mm512_storeu_ps(out[i] + j * kCols, acc[i][j]);
  }
}

bool cpu_has_dot() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
  }();
  return has;
}
#else
#define PAGEDSPEC_HAS_DOT 0
bool cpu_has_dot() { return false; }
#endif

template <int R, int Q>
void accumulate(Path path, const Rows& x, int64_t row, const uint16_t* const (&panels)[Q],
                int64_t K2, float (&out)[R][Q * kCols]) {
#if PAGEDSPEC_HAS_DOT
  if (path == Path::kDot) return accumulate_dot<R, Q>(x.pairs + row * x.ld, x.ld, panels, K2, out);
#endif
  accumulate_widen<R, Q>(x.floats + row * x.ld, x.ld, panels, K2, out);
}

// Where a tile's results go: n columns of rows of a float32 or bf16 output.
struct Out {
  float* f32 = nullptr;
  at::BFloat16* b16 = nullptr;
  int64_t ld = 0;

  void store(int64_t row, int64_t col, const float* values, int64_t n) const {
    if (f32) {
      std::memcpy(f32 + row * ld + col, values, n * sizeof(float));
    } else {
      at::vec::convert(values, b16 + row * ld + col, n);  // round to nearest even, as .to()
    }
  }
};

// fn(R as a constant, first row, group) over tiles of rows in chunks of kChunkRows rows and
// groups of panels split across threads.
template <int Q, typename Fn>
void over_tiles(Path path, int64_t M, int64_t groups, const Fn& fn) {
  for (int64_t m = 0; m < M; m += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        if (path == Path::kDot) {
          row_tiles<kDotRows, true>(rows, [&](auto r, int64_t i) { fn(r, m + i, g); });
        } else {
          row_tiles<widen_rows<Q>(), true>(rows, [&](auto r, int64_t i) { fn(r, m + i, g); });
        }
      }
    });
  }
}

// x as the path reads it: kDot wants bf16 pairs, kWiden float32; a copy (K padded to even) only
// where x is not already that.
struct PreparedRows {
  Rows rows;
  at::Tensor keep;               // x itself, when read in place
  std::vector<uint16_t> pairs;   // bf16 copy
  std::vector<float> floats;     // float32 copy
};

void prepare(Path path, const at::Tensor& x, int64_t K2, PreparedRows& prep) {
  const int64_t M = x.size(0), K = x.size(1);
  if (path == Path::kDot && x.scalar_type() == at::kBFloat16 && K == 2 * K2 &&
      x.is_contiguous()) {
    prep.keep = x;
    prep.rows.pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
    prep.rows.ld = K2;
    return;
  }
  if (path == Path::kWiden && x.scalar_type() == at::kFloat && K == 2 * K2 && x.is_contiguous()) {
    prep.keep = x;
    prep.rows.floats = x.data_ptr<float>();
    prep.rows.ld = 2 * K2;
    return;
  }
  const auto xc = x.contiguous();
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const auto* xb = bf16 ? xc.data_ptr<at::BFloat16>() : nullptr;
  const float* xf = bf16 ? nullptr : xc.data_ptr<float>();
  auto value = [&](int64_t i, int64_t k) { return bf16 ? float(xb[i * K + k]) : xf[i * K + k]; };
  if (path == Path::kDot) {
    prep.pairs.assign(M * 2 * K2, 0);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t k = 0; k < K; ++k) prep.pairs[i * 2 * K2 + k] = at::BFloat16(value(i, k)).x;
    }
    prep.rows.pairs = reinterpret_cast<const uint32_t*>(prep.pairs.data());
    prep.rows.ld = K2;
  } else {
    prep.floats.assign(M * 2 * K2, 0.f);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t k = 0; k < K; ++k) prep.floats[i * 2 * K2 + k] = value(i, k);
    }
    prep.rows.floats = prep.floats.data();
    prep.rows.ld = 2 * K2;
  }
}

Path choose(bool dot) { return dot && cpu_has_dot() ? Path::kDot : Path::kWiden; }

void check_packed(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK_VALUE(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 &&
                        packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                        packed.device().is_cpu(),
                    "packed must come from pack_linear_weight_bf16");
  const int64_t K2 = packed.size(1);
  TORCH_CHECK_VALUE(x.dim() == 2 && (x.size(1) + 1) / 2 == K2 &&
                        (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                        x.device().is_cpu(),
                    "x must be a bfloat16 or float32 CPU tensor [rows, ", 2 * K2 - 1, " or ",
                    2 * K2, "], got ", x.sizes(), " ", x.scalar_type());
}

Out output_of(at::Tensor& out) {
  Out o;
  o.ld = out.size(1);
  if (out.scalar_type() == at::kFloat) {
    o.f32 = out.data_ptr<float>();
  } else {
    o.b16 = out.data_ptr<at::BFloat16>();
  }
  return o;
}

void pack_panels(const uint16_t* src, int64_t N, int64_t K, uint16_t* dst, int64_t first,
                 int64_t last) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t p = first; p < last; ++p) {
    for (int64_t c = 0; c < kCols && p * kCols + c < N; ++c) {
      const uint16_t* row = src + (p * kCols + c) * K;
      for (int64_t k = 0; k < K; ++k) dst[(p * K2 + k / 2) * kLine + c * 2 + k % 2] = row[k];
    }
  }
}

// out = x W^T + bias over tiles of Q panels (bias padded to whole panels).
template <int Q>
void plain_product(Path path, const Rows& x, int64_t M, const uint16_t* wp, int64_t panels,
                   int64_t K2, const float* bias, int64_t N, const Out& o) {
  const int64_t groups = (panels + Q - 1) / Q;
  over_tiles<Q>(path, M, groups, [&](auto tile_rows, int64_t row, int64_t g) {
    constexpr int R = decltype(tile_rows)::value;
    const int64_t first = g * Q;
    const uint16_t* ptrs[Q];
    for (int j = 0; j < Q; ++j) {  // past the last panel: repeat it, never stored
      ptrs[j] = wp + std::min(first + j, panels - 1) * K2 * kLine;
    }
    float sums[R][Q * kCols];
    accumulate<R, Q>(path, x, row, ptrs, K2, sums);
    const int64_t cols = std::min(Q * kCols, N - first * kCols);
    for (int i = 0; i < R; ++i) {
      for (int64_t c = 0; c < cols; ++c) sums[i][c] += bias[first * kCols + c];
      o.store(row + i, first * kCols, sums[i], cols);
    }
  });
}

// silu(gate) * up over tiles of P gate panels and the P up panels half further on: one tile of
// 2P panels, or (Split) a tile of the P gate panels and one of the P up panels, each with as
// many rows as the registers then hold.
template <int P, bool Split>
void gated_product(Path path, const Rows& x, int64_t M, const uint16_t* wp, int64_t half,
                   int64_t K2, int64_t intermediate, const Out& o) {
  constexpr int Q = Split ? P : 2 * P;
  const int64_t groups = (half + P - 1) / P;
  over_tiles<Q>(path, M, groups, [&](auto tile_rows, int64_t row, int64_t g) {
    constexpr int R = decltype(tile_rows)::value;
    const int64_t first = g * P;
    const uint16_t* ptrs[2 * P];
    for (int j = 0; j < P; ++j) {  // gate panels, then the up panels half further on
      ptrs[j] = wp + std::min(first + j, half - 1) * K2 * kLine;
      ptrs[P + j] = ptrs[j] + half * K2 * kLine;
    }
    float gate[R][P * kCols], up[R][P * kCols];
    if constexpr (Split) {
      const uint16_t* gate_ptrs[P];
      const uint16_t* up_ptrs[P];
      std::copy(ptrs, ptrs + P, gate_ptrs);
      std::copy(ptrs + P, ptrs + 2 * P, up_ptrs);
      accumulate<R, P>(path, x, row, gate_ptrs, K2, gate);
      accumulate<R, P>(path, x, row, up_ptrs, K2, up);
    } else {
      float sums[R][2 * P * kCols];
      accumulate<R, 2 * P>(path, x, row, ptrs, K2, sums);
      for (int i = 0; i < R; ++i) {
        std::copy(sums[i], sums[i] + P * kCols, gate[i]);
        std::copy(sums[i] + P * kCols, sums[i] + 2 * P * kCols, up[i]);
      }
    }
    const int64_t cols = std::min(P * kCols, intermediate - first * kCols);
    for (int i = 0; i < R; ++i) {
      float act[P * kCols];
      for (int64_t c = 0; c < cols; ++c) {
        act[c] = gate[i][c] / (1.f + std::exp(-gate[i][c])) * up[i][c];
      }
      o.store(row + i, first * kCols, act, cols);
    }
  });
}

}  // namespace

at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(
      weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
      "weight must be a 2-D bfloat16 CPU tensor, got ", weight.sizes(), " ", weight.scalar_type(),
      " on ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kCols - 1) / kCols, K2 = (K + 1) / 2;
  const auto w = weight.contiguous();
  auto packed = at::zeros({panels, K2, kCols, 2}, w.options());  // padding stays 0
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    pack_panels(src, N, K, dst, begin, end);
  });
  return packed;
}

at::Tensor pack_linear_weight_bf16_(at::Tensor& weight) {
  if (weight.dim() != 2 || weight.size(0) % kCols != 0 || weight.size(1) % 2 != 0 ||
      !weight.is_contiguous() || weight.scalar_type() != at::kBFloat16 ||
      !weight.device().is_cpu()) {
    return pack_linear_weight_bf16(weight);  // (which rejects what no pack takes)
  }
  const int64_t N = weight.size(0), K = weight.size(1);
  // Panel p is rows [16p, 16p + 16): the same 16 * K values, reordered in place.
  auto* w = reinterpret_cast<uint16_t*>(weight.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> rows(kCols * K);
    for (int64_t p = begin; p < end; ++p) {
      uint16_t* panel = w + p * kCols * K;
      std::copy(panel, panel + kCols * K, rows.begin());
      pack_panels(rows.data(), kCols, K, panel, 0, 1);
    }
  });
  return weight.view({N / kCols, K / 2, kCols, 2});
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features, bool dot) {
  check_packed(x, packed);
  const int64_t K2 = packed.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK_VALUE(N > (panels - 1) * kCols && N <= panels * kCols, "out_features ", N,
                    " does not match the packed weight");
  std::vector<float> b(panels * kCols, 0.f);  // padded to whole panels
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "bias must be [", N, "]");
    const auto bf = bias->to(at::kFloat).contiguous();
    std::copy(bf.data_ptr<float>(), bf.data_ptr<float>() + N, b.begin());
  }
  const Path path = choose(dot);
  PreparedRows prep;
  prepare(path, x, K2, prep);
  auto out = at::empty({x.size(0), N}, x.options());
  const Out o = output_of(out);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (x.size(0) <= kFewRows) {
    plain_product<kFewRowsPanels>(path, prep.rows, x.size(0), wp, panels, K2, b.data(), N, o);
  } else {
    plain_product<kPanels>(path, prep.rows, x.size(0), wp, panels, K2, b.data(), N, o);
  }
  return out;
}

at::Tensor linear_silu_mul_bf16(const at::Tensor& x, const at::Tensor& packed,
                                int64_t intermediate, bool dot) {
  check_packed(x, packed);
  const int64_t K2 = packed.size(1), half = packed.size(0) / 2;
  TORCH_CHECK_VALUE(intermediate % kCols == 0 && packed.size(0) * kCols == 2 * intermediate,
                    "packed must be a gate_up weight of 2 * ", intermediate,
                    " rows, a multiple of ", kCols, " each");
  const Path path = choose(dot);
  PreparedRows prep;
  prepare(path, x, K2, prep);
  auto out = at::empty({x.size(0), intermediate}, x.options());
  const Out o = output_of(out);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if constexpr (kSplitGated) {
    if (x.size(0) > kFewRows) {
      gated_product<1, true>(path, prep.rows, x.size(0), wp, half, K2, intermediate, o);
      return out;
    }
  }
  gated_product<kGatedPanels, false>(path, prep.rows, x.size(0), wp, half, K2, intermediate, o);
  return out;
}

bool linear_bf16_has_dot() { return cpu_has_dot(); }
