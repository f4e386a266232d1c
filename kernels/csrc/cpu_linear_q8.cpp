// y = x W^T + b on the CPU for an int8 weight-only weight (GGUF Q8_0's numbers), float32
// activations and sums.
//
// Why our own: at one row (batch-1 decode, bound by reading the weights) torch's
// _weight_int8pack_mm ran 3x slower than the float32 GEMM (1.9x faster with bf16 activations,
// still 4x off what the bytes allow), oneDNN's int8 linear (qlinear_pointwise) needs int8
// activations and costs ~0.6 ms a call at one row, and torchao's wheel has no CPU kernel
// (README; python -m benchmarks.linear has the library columns).
//
// The weight [N, K] is Q8_0: per output row, blocks of kQ8Block along K, each an int8 vector q and
// one scale d, w = d * q. It is packed like the float32 GEMM's (cpu_linear.cpp) into panels of
// V output columns: q as [N/V][K][V] int8 (one k step of a panel is V bytes, converted to V
// floats by one sign-extension and one conversion) and d as [N/V][ceil(K/kQ8Block)][V] float32.
// Each weight vector is dequantised as float(q) * d, then multiplied as in the float32 kernel:
// every output element is one FMA chain over k in order. Up to kDirectRows rows, a tile
// dequantises each weight vector in registers (the weight streams once: bandwidth-bound). More
// rows share a tile group's dequantised panels through a float32 buffer (L2-sized), so the
// conversion is paid once per kChunkRows rows rather than once per row tile. Both paths produce
// the same bits: a row's result does not depend on the number of rows or the thread count.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t kQ8Block = 32;  // GGUF's QK8_0
// Tiles as in cpu_linear.cpp: kTileRows * kTilePanels accumulators + kTilePanels weight vectors.
constexpr int kTileRows = V >= 16 ? 8 : 4;
constexpr int kTilePanels = 3;
constexpr int kGatedRows = V >= 16 ? 6 : 2;
constexpr int kGatedPanels = 2;
constexpr int64_t kChunkRows = 256;
// Up to this many rows every tile dequantises in registers; beyond, through the panel buffer.
constexpr int64_t kDirectRows = kTileRows;

// V consecutive int8 weights as V floats.
C10_ALWAYS_INLINE Vec load_q8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
  float w[V];
  for (int64_t c = 0; c < V; ++c) w[c] = p[c];
  return Vec::loadu(w);
#endif
}

// Weight vectors of a group of panels, dequantised on the fly: w[j] = q[k] * d[k / kQ8Block].
struct Q8Panels {
  const int8_t* q;
  const float* d;
  int64_t q_stride, d_stride;  // from one panel to the next
  C10_ALWAYS_INLINE Vec operator()(int64_t j, int64_t k) const {
    return load_q8(q + j * q_stride + k * V) * Vec::loadu(d + j * d_stride + (k / kQ8Block) * V);
  }
};

// Weight vectors of panels already dequantised into a float32 buffer [P][K][V].
struct FloatPanels {
  const float* w;
  int64_t stride;
  C10_ALWAYS_INLINE Vec operator()(int j, int64_t k) const {
    return Vec::loadu(w + j * stride + k * V);
  }
};

// acc[i][j] += x[i, :] . (panel j), over all of K; panels(j, k) gives panel j's weights at k.
template <int R, int P, typename Panels>
C10_ALWAYS_INLINE void accumulate(const float* x, int64_t ldx, const Panels& panels, int64_t K,
                                  Vec (&acc)[R][P]) {
  for (int64_t k = 0; k < K; ++k) {
    Vec w[P];
    for (int j = 0; j < P; ++j) w[j] = panels(j, k);
    for (int i = 0; i < R; ++i) {
      const Vec xi(x[i * ldx + k]);
      for (int j = 0; j < P; ++j) acc[i][j] = at::vec::fmadd(xi, w[j], acc[i][j]);
    }
  }
}

// out = x . panels + bias for R rows and P panels; the last panel has last_cols real columns.
template <int R, int P, typename Panels>
void tile(const float* x, int64_t ldx, const Panels& panels, int64_t K, const float* bias,
          float* out, int64_t ldo, int64_t last_cols) {
  Vec acc[R][P];
  for (int j = 0; j < P; ++j) {
    const Vec init = bias ? Vec::loadu(bias + j * V, j == P - 1 ? last_cols : V) : Vec(0.f);
    for (int i = 0; i < R; ++i) acc[i][j] = init;
  }
  accumulate<R, P>(x, ldx, panels, K, acc);
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < P; ++j) acc[i][j].store(out + i * ldo + j * V, j == P - 1 ? last_cols : V);
  }
}

// silu(gate) * up: panels 0..P-1 are gate panels, P..2P-1 the matching up panels.
template <int R, int P, typename Panels>
void gated_tile(const float* x, int64_t ldx, const Panels& panels, int64_t K, float* out,
                int64_t ldo) {
  Vec acc[R][2 * P];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 2 * P; ++j) acc[i][j] = Vec(0.f);
  }
  accumulate<R, 2 * P>(x, ldx, panels, K, acc);
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
    for (; i + RMax / 2 <= M; i += RMax / 2) fn(std::integral_constant<int, RMax / 2>{}, i);
  }
  for (; i + 2 <= M; i += 2) fn(std::integral_constant<int, 2>{}, i);
  for (; i < M; ++i) fn(std::integral_constant<int, 1>{}, i);
}

// Dequantises `count` panels starting at q/d into buf [count][K][V] (the Q8Panels arithmetic).
void dequantize_panels(const Q8Panels& panels, int count, int64_t K, float* buf) {
  for (int j = 0; j < count; ++j) {
    for (int64_t k = 0; k < K; ++k) panels(j, k).store(buf + (j * K + k) * V);
  }
}

// fn(first row, rows, panels of the group, panel count) for chunks of kChunkRows rows and groups
// of `per_group` panels (the panels to dequantise: `gated` groups add the up panels `half`
// panels on) split across threads. Few rows read the packed weight directly; more rows read a
// per-thread buffer the group's panels are dequantised into once per chunk.
template <typename Fn>
void over_groups(const at::Tensor& x, const at::Tensor& pq, const at::Tensor& pd, int64_t panels,
                 int per_group, int64_t half, const Fn& fn) {
  const int64_t M = x.size(0), K = pq.size(1), nb = pd.size(1);
  const int8_t* q = pq.data_ptr<int8_t>();
  const float* d = pd.data_ptr<float>();
  const int64_t groups = (panels + per_group - 1) / per_group;
  for (int64_t m = 0; m < M; m += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - m);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * per_group;
        const int count = static_cast<int>(std::min<int64_t>(per_group, panels - first));
        // Panel j < count of the group is panel first + j; with `half`, panel count + j is
        // the up panel first + half + j.
        const Q8Panels direct{q + first * K * V, d + first * nb * V, K * V, nb * V};
        if (rows <= kDirectRows) {
          fn(m, rows, direct, first, count);
          continue;
        }
        const int total = half ? 2 * count : count;
        buf.resize(total * K * V);
        dequantize_panels(direct, count, K, buf.data());
        if (half) {
          const Q8Panels ups{direct.q + half * K * V, direct.d + half * nb * V, K * V, nb * V};
          dequantize_panels(ups, count, K, buf.data() + count * K * V);
        }
        fn(m, rows, FloatPanels{buf.data(), K * V}, first, count);
      }
    });
  }
}

void check_packed_q8(const at::Tensor& x, const at::Tensor& pq, const at::Tensor& pd) {
  TORCH_CHECK_VALUE(pq.dim() == 3 && pq.size(2) == V && pq.scalar_type() == at::kChar &&
                        pq.is_contiguous() && pd.dim() == 3 && pd.size(0) == pq.size(0) &&
                        pd.size(1) == (pq.size(1) + kQ8Block - 1) / kQ8Block &&
                        pd.size(2) == V && pd.scalar_type() == at::kFloat && pd.is_contiguous(),
                    "packed weight and scales must come from pack_q8_weight on this CPU");
  TORCH_CHECK_VALUE(
      x.dim() == 2 && x.size(1) == pq.size(1) && x.scalar_type() == at::kFloat &&
          x.device().is_cpu(),
      "x must be a float32 CPU tensor [rows, ", pq.size(1), "], got ", x.sizes(), " ",
      x.scalar_type());
}

}  // namespace

std::vector<at::Tensor> pack_q8_weight(const at::Tensor& qs, const at::Tensor& scales) {
  TORCH_CHECK_VALUE(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.device().is_cpu(),
                    "qs must be a 2-D int8 CPU tensor, got ", qs.sizes(), " ", qs.scalar_type());
  const int64_t N = qs.size(0), K = qs.size(1), nb = (K + kQ8Block - 1) / kQ8Block;
  TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == nb &&
                        scales.scalar_type() == at::kFloat && scales.device().is_cpu(),
                    "scales must be float32 [", N, ", ", nb, "], got ", scales.sizes(), " ",
                    scales.scalar_type());
  const int64_t panels = (N + V - 1) / V;
  const auto q = qs.contiguous();
  const auto s = scales.contiguous();
  auto pq = at::zeros({panels, K, V}, q.options());  // columns past N: weight 0, scale 0
  auto pd = at::zeros({panels, nb, V}, s.options());
  const int8_t* qsrc = q.data_ptr<int8_t>();
  const float* ssrc = s.data_ptr<float>();
  int8_t* qdst = pq.data_ptr<int8_t>();
  float* sdst = pd.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < V && p * V + c < N; ++c) {
        const int64_t n = p * V + c;
        for (int64_t k = 0; k < K; ++k) qdst[(p * K + k) * V + c] = qsrc[n * K + k];
        for (int64_t b = 0; b < nb; ++b) sdst[(p * nb + b) * V + c] = ssrc[n * nb + b];
      }
    }
  });
  return {pq, pd};
}

at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& packed_q, const at::Tensor& packed_d,
                     const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_packed_q8(x, packed_q, packed_d);
  const int64_t K = packed_q.size(1), N = out_features, panels = packed_q.size(0);
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
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  over_groups(xc, packed_q, packed_d, panels, kTilePanels, 0,
              [&](int64_t m, int64_t rows, const auto& group, int64_t first, int count) {
                const int64_t last_cols = std::min(V, N - (first + count - 1) * V);
                const float* bias_cols = bp ? bp + first * V : nullptr;
                row_tiles<kTileRows>(rows, [&](auto tile_rows, int64_t i) {
                  constexpr int R = decltype(tile_rows)::value;
                  const float* xi = xp + (m + i) * K;
                  float* oi = op + (m + i) * N + first * V;
                  switch (count) {
                    case 1: return tile<R, 1>(xi, K, group, K, bias_cols, oi, N, last_cols);
                    case 2: return tile<R, 2>(xi, K, group, K, bias_cols, oi, N, last_cols);
                    default:
                      return tile<R, kTilePanels>(xi, K, group, K, bias_cols, oi, N, last_cols);
                  }
                });
              });
  return out;
}

at::Tensor linear_silu_mul_q8(const at::Tensor& x, const at::Tensor& packed_q,
                              const at::Tensor& packed_d, int64_t intermediate) {
  check_packed_q8(x, packed_q, packed_d);
  const int64_t K = packed_q.size(1), half = packed_q.size(0) / 2;
  TORCH_CHECK_VALUE(intermediate % V == 0 && packed_q.size(0) * V == 2 * intermediate,
                    "packed must be a gate_up weight of 2 * ", intermediate,
                    " rows, a multiple of ", V, " each");
  const auto xc = x.contiguous();
  auto out = at::empty({xc.size(0), intermediate}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_groups(
      xc, packed_q, packed_d, half, kGatedPanels, half,
      [&](int64_t m, int64_t rows, const auto& group, int64_t first, int count) {
        row_tiles<kGatedRows>(rows, [&](auto tile_rows, int64_t i) {
          constexpr int R = decltype(tile_rows)::value;
          const float* xi = xp + (m + i) * K;
          float* oi = op + (m + i) * intermediate + first * V;
          using Group = std::decay_t<decltype(group)>;
          // Gate panel j is the group's panel j; its up panel is `half` panels on (direct) or
          // `count` panels on in the buffer.
          if constexpr (std::is_same_v<Group, Q8Panels>) {
            const auto with_up = [&](auto p) {
              constexpr int P = decltype(p)::value;
              const auto panels = [&](int j, int64_t k) {
                return j < P ? group(j, k) : group(j - P + half, k);
              };
              gated_tile<R, P>(xi, K, panels, K, oi, intermediate);
            };
            if (count < kGatedPanels) return with_up(std::integral_constant<int, 1>{});
            return with_up(std::integral_constant<int, kGatedPanels>{});
          } else {
            const auto with_up = [&](auto p) {
              constexpr int P = decltype(p)::value;
              const auto panels = [&](int j, int64_t k) {
                return j < P ? group(j, k) : group(j - P + count, k);
              };
              gated_tile<R, P>(xi, K, panels, K, oi, intermediate);
            };
            if (count < kGatedPanels) return with_up(std::integral_constant<int, 1>{});
            return with_up(std::integral_constant<int, kGatedPanels>{});
          }
        });
      });
  return out;
}
