// y = x W^T + b on the CPU in float32, for a weight packed once (pack_linear_weight).
//
// oneDNN (torch.ops.mkldnn) and MKL are tuned for large products; at the row counts of batched
// decode and short prefill chunks (3 to a few hundred rows) on the 2-core dev CPU, oneDNN's
// packed GEMM reached 130-190 GFLOP/s on SmolLM2's shapes (MKL half that) and costs ~15 us of
// fixed overhead per call. This kernel reaches 175-220 from 16 rows up (python -m
// benchmarks.linear). The weight [N, K] is packed into panels of V = Vec::size() output columns,
// [N/V][K][V], so that one k step of a panel is one vector load; a tile of kTileRows rows by
// kTilePanels panels keeps its sums in registers across all of K, each x element broadcast once
// per tile row and k. Tiles split across threads by panels; rows are taken in chunks of
// kChunkRows so that a chunk of x stays in L2 while the weight streams past it. Every output
// element is summed over k in order by one FMA chain: its value does not depend on the number
// of rows, the tiling or the thread count.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
// Registers: kTileRows * kTilePanels accumulators + kTilePanels weight vectors (32 on AVX512,
// 16 on AVX2).
constexpr int kTileRows = V >= 16 ? 8 : 4;
constexpr int kTilePanels = 3;
// silu(gate) * up tiles hold a gate and an up accumulator per (row, panel): 6 x 2 measured
// faster than 4 x 3 and 8 x 1 at 32 and 2048 rows on the dev CPU.
constexpr int kGatedRows = V >= 16 ? 6 : 2;
constexpr int kGatedPanels = 2;
constexpr int64_t kChunkRows = 256;
// Each panel of a tile is prefetched this far ahead of its loads (a group's panels are
// contiguous, so past the last panel's end this reaches the next group's, which the thread reads
// next). From 2 rows up the tile's FMAs leave fewer weight loads in flight than the DRAM stream
// needs: on an AVX512 Xeon, in an interleaved microbenchmark of SmolLM2-135M's float32 weights,
// 7 rows (a draft tree's verification) took 1.23-1.37x the time of 1 row without it and
// 1.09-1.13x with it, and 1 row ran 3-5% faster (1 KB beat 512 B, 1.5 KB, 2 KB and 8 KB).
// Unmeasured on AVX2, where a 64-byte line spans two k steps and is prefetched twice.
constexpr int64_t kPrefetchFloats = 1024 / sizeof(float);
// acc[i][j] += x[i, :] . (column block j of the weight) for R rows and P panels, over all of K.
template <int R, int P>
C10_ALWAYS_INLINE void accumulate(const float* x, int64_t ldx, const float* const (&panels)[P],
                                  int64_t K, Vec (&acc)[R][P]) {
  for (int64_t k = 0; k < K; ++k) {
    Vec w[P];
    for (int j = 0; j < P; ++j) __builtin_prefetch(panels[j] + k * V + kPrefetchFloats);
    for (int j = 0; j < P; ++j) w[j] = Vec::loadu(panels[j] + k * V);
    for (int i = 0; i < R; ++i) {
      const Vec xi(x[i * ldx + k]);
      for (int j = 0; j < P; ++j) acc[i][j] = at::vec::fmadd(xi, w[j], acc[i][j]);
    }
  }
}

// out[i][j * V + c] = x[i] . w[j * V + c] + bias for R rows, P panels; the last panel has
// last_cols real columns.
template <int R, int P>
void tile(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
          float* out, int64_t ldo, int64_t last_cols) {
  Vec acc[R][P];
  const float* panels[P];
  for (int j = 0; j < P; ++j) {
    panels[j] = panel + j * K * V;
    const Vec init = bias ? Vec::loadu(bias + j * V, j == P - 1 ? last_cols : V) : Vec(0.f);
    for (int i = 0; i < R; ++i) acc[i][j] = init;
  }
  accumulate<R, P>(x, ldx, panels, K, acc);
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < P; ++j) acc[i][j].store(out + i * ldo + j * V, j == P - 1 ? last_cols : V);
  }
}

// silu(gate) * up for P gate panels and the P up panels up_offset floats further on (a packed
// gate_up weight: gate rows, then up rows); only the product is stored.
template <int R, int P>
void gated_tile(const float* x, int64_t ldx, const float* panel, int64_t up_offset, int64_t K,
                float* out, int64_t ldo) {
  Vec acc[R][2 * P];
  const float* panels[2 * P];
  for (int j = 0; j < P; ++j) {
    panels[j] = panel + j * K * V;
    panels[P + j] = panels[j] + up_offset;
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 2 * P; ++j) acc[i][j] = Vec(0.f);
  }
  accumulate<R, 2 * P>(x, ldx, panels, K, acc);
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < P; ++j) silu_mul(acc[i][j], acc[i][P + j]).store(out + i * ldo + j * V);
  }
}

// fn(first row, rows, group) for chunks of kChunkRows rows, groups of panels split across threads.
template <typename Fn>
void over_chunks(int64_t M, int64_t groups, const Fn& fn) {
  for (int64_t m = 0; m < M; m += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) fn(m, rows, g);
    });
  }
}

void check_packed(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == V && packed.scalar_type() == at::kFloat &&
                        packed.is_contiguous(),
                    "packed must come from pack_linear_weight on this CPU");
  TORCH_CHECK_VALUE(
      x.dim() == 2 && x.size(1) == packed.size(1) && x.scalar_type() == at::kFloat &&
          x.device().is_cpu(),
      "x must be a float32 CPU tensor [rows, ", packed.size(1), "], got ", x.sizes(), " ",
      x.scalar_type());
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(
      weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
      "weight must be a 2-D float32 CPU tensor, got ", weight.sizes(), " ", weight.scalar_type(),
      " on ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + V - 1) / V;
  const auto w = weight.contiguous();
  auto packed = at::zeros({panels, K, V}, w.options());  // columns past N stay 0
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < V && p * V + c < N; ++c) {
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * V + c] = src[(p * V + c) * K + k];
      }
    }
  });
  return packed;
}

at::Tensor pack_linear_weight_(at::Tensor& weight) {
  if (weight.dim() != 2 || weight.size(0) % V != 0 || !weight.is_contiguous() ||
      weight.scalar_type() != at::kFloat || !weight.device().is_cpu()) {
    return pack_linear_weight(weight);  // (which rejects what no pack takes)
  }
  const int64_t N = weight.size(0), K = weight.size(1);
  // Panel p is rows [p * V, (p + 1) * V): the same V * K floats, transposed in place.
  float* w = weight.data_ptr<float>();
  at::parallel_for(0, N / V, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(V * K);
    for (int64_t p = begin; p < end; ++p) {
      float* panel = w + p * V * K;
      std::copy(panel, panel + V * K, rows.begin());
      for (int64_t c = 0; c < V; ++c) {
        for (int64_t k = 0; k < K; ++k) panel[k * V + c] = rows[c * K + k];
      }
    }
  });
  return weight.view({N / V, K, V});
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_packed(x, packed);
  const int64_t K = packed.size(1), N = out_features, panels = packed.size(0);
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
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Groups of P panels, each over the call's row tiles (by_row_count).
  auto run = [&](auto panels_per_group, const auto& tiles) {
    constexpr int P = decltype(panels_per_group)::value;
    over_chunks(xc.size(0), (panels + P - 1) / P, [&](int64_t m, int64_t rows, int64_t g) {
      const int64_t first = g * P, count = std::min<int64_t>(P, panels - first);
      const int64_t last_cols = std::min(V, N - (first + count - 1) * V);  // rest: zero padding
      const float* panel = wp + first * K * V;
      const float* bias_cols = bp ? bp + first * V : nullptr;
      tiles(rows, [&](auto tile_rows, int64_t i) {
        constexpr int R = decltype(tile_rows)::value;
        const float* xi = xp + (m + i) * K;
        float* oi = op + (m + i) * N + first * V;
        if constexpr (P >= 3) {
          if (count == 2) return tile<R, 2>(xi, K, panel, K, bias_cols, oi, N, last_cols);
        }
        if constexpr (P >= 2) {
          if (count == 1) return tile<R, 1>(xi, K, panel, K, bias_cols, oi, N, last_cols);
        }
        tile<R, P>(xi, K, panel, K, bias_cols, oi, N, last_cols);
      });
    });
  };
  by_row_count<1, 1, kTilePanels, kTileRows, true>(xc.size(0), run);
  return out;
}

at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
  check_packed(x, packed);
  const int64_t K = packed.size(1), half = packed.size(0) / 2;
  TORCH_CHECK_VALUE(intermediate % V == 0 && packed.size(0) * V == 2 * intermediate,
                    "packed must be a gate_up weight of 2 * ", intermediate,
                    " rows, a multiple of ", V, " each");
  const auto xc = x.contiguous();
  auto out = at::empty({xc.size(0), intermediate}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](auto panels_per_group, const auto& tiles) {
    constexpr int P = decltype(panels_per_group)::value;
    over_chunks(xc.size(0), (half + P - 1) / P, [&](int64_t m, int64_t rows, int64_t g) {
      const int64_t first = g * P, count = std::min<int64_t>(P, half - first);
      const float* panel = wp + first * K * V;
      tiles(rows, [&](auto tile_rows, int64_t i) {
        constexpr int R = decltype(tile_rows)::value;
        const float* xi = xp + (m + i) * K;
        float* oi = op + (m + i) * intermediate + first * V;
        if constexpr (P >= 2) {
          if (count == 1) {  // the last group of an odd number of panels
            return gated_tile<R, 1>(xi, K, panel, half * K * V, K, oi, intermediate);
          }
        }
        gated_tile<R, P>(xi, K, panel, half * K * V, K, oi, intermediate);
      });
    });
  };
  by_row_count<2, 2, kGatedPanels, kGatedRows, true>(xc.size(0), run);
  return out;
}
