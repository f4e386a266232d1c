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

#include "cpu_kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
// Registers: kTileRows * kTilePanels accumulators + kTilePanels weight vectors (32 on AVX512,
// 16 on AVX2).
constexpr int kTileRows = V >= 16 ? 8 : 4;
constexpr int kTilePanels = 3;
constexpr int64_t kChunkRows = 256;

// out[i][j * V + c] (+= nothing: written) for i < R, panels j < P, columns c < cols of the last.
template <int R, int P>
void tile(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
          float* out, int64_t ldo, int64_t last_cols) {
  Vec acc[R][P];
  for (int j = 0; j < P; ++j) {
    const Vec init = bias ? Vec::loadu(bias + j * V, j == P - 1 ? last_cols : V) : Vec(0.f);
    for (int i = 0; i < R; ++i) acc[i][j] = init;
  }
  for (int64_t k = 0; k < K; ++k) {
    Vec w[P];
    for (int j = 0; j < P; ++j) w[j] = Vec::loadu(panel + (j * K + k) * V);
    for (int i = 0; i < R; ++i) {
      const Vec xi(x[i * ldx + k]);
      for (int j = 0; j < P; ++j) acc[i][j] = at::vec::fmadd(xi, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < P; ++j) acc[i][j].store(out + i * ldo + j * V, j == P - 1 ? last_cols : V);
  }
}

// Rows [0, M) of one group of P panels, kTileRows rows at a time, then the rest in halves.
template <int P>
void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias,
                float* out, int64_t N, int64_t last_cols) {
  int64_t i = 0;
  for (; i + kTileRows <= M; i += kTileRows) {
    tile<kTileRows, P>(x + i * K, K, panel, K, bias, out + i * N, N, last_cols);
  }
  for (; i + kTileRows / 2 <= M; i += kTileRows / 2) {
    tile<kTileRows / 2, P>(x + i * K, K, panel, K, bias, out + i * N, N, last_cols);
  }
  for (; i + 2 <= M; i += 2) tile<2, P>(x + i * K, K, panel, K, bias, out + i * N, N, last_cols);
  for (; i < M; ++i) tile<1, P>(x + i * K, K, panel, K, bias, out + i * N, N, last_cols);
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                    "weight must be a 2-D float32 CPU tensor, got ", weight.sizes(), " ",
                    weight.scalar_type(), " on ", weight.device());
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

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features) {
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == V && packed.scalar_type() == at::kFloat,
                    "packed must come from pack_linear_weight on this CPU");
  const int64_t K = packed.size(1), N = out_features, panels = packed.size(0);
  TORCH_CHECK_VALUE(N > (panels - 1) * V && N <= panels * V, "out_features ", N,
                    " does not match the packed weight");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "x must be a float32 CPU tensor [rows, ", K, "], got ", x.sizes(), " ",
                    x.scalar_type());
  const auto xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK_VALUE(b.dim() == 1 && b.size(0) == N && b.scalar_type() == at::kFloat,
                      "bias must be float32 [", N, "]");
  }
  const int64_t M = xc.size(0);
  auto out = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
  for (int64_t m = 0; m < M; m += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * kTilePanels, count = std::min<int64_t>(kTilePanels, panels - first);
        // Columns of the group's last panel that exist (the packed tail is zero padding).
        const int64_t last_cols = std::min(V, N - (first + count - 1) * V);
        const float* panel = wp + first * K * V;
        const float* bias_cols = bp ? bp + first * V : nullptr;
        float* out_cols = op + m * N + first * V;
        const float* x_rows = xp + m * K;
        switch (count) {
          case 1: panel_rows<1>(x_rows, rows, K, panel, bias_cols, out_cols, N, last_cols); break;
          case 2: panel_rows<2>(x_rows, rows, K, panel, bias_cols, out_cols, N, last_cols); break;
          default: panel_rows<kTilePanels>(x_rows, rows, K, panel, bias_cols, out_cols, N, last_cols);
        }
      }
    });
  }
  return out;
}
