// y = x W^T + b on the CPU for an int8 weight (GGUF Q8_0's numbers), float32 x, y and sums.
//
// Why our own: at one row (batch-1 decode, bound by reading the weights) torch's
// _weight_int8pack_mm ran 3x slower than the float32 GEMM (1.9x faster with bf16 activations,
// still 4x off what the bytes allow), oneDNN's int8 linear (qlinear_pointwise) needs int8
// activations and costs ~0.6 ms a call at one row, and torchao's wheel has no CPU kernel
// (README; python -m benchmarks.linear has the library columns).
//
// The weight [N, K] is Q8_0: per output row, blocks of kBlock along K, each an int8 vector q and
// one float16 scale d, w = d * q. The products run in integers, so that the int8 weights are
// multiplied as they are read instead of being converted to floats first (a conversion and a
// scale per weight made the float kernel compute-bound at ~12 GB/s):
// - each row of x is quantised per block of kBlock to int16: s = max|x| / 32767 and
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
// to one vector of 2V int16; d as [N/V][Kp/kBlock][V] float16.
//
// The GEMM itself (activation quantisation, tiles, threads) is cpu_int_dot.h's, shared with the
// Q4_1 kernel (cpu_linear_q4.cpp); this file is the Q8_0 pack and its per-block scaling.

#include "cpu_int_dot.h"

namespace {

using namespace int_dot;

// Q8_0 panels of a group: panel j's k pair t at q + j * q_stride + t * 2V, its block b's
// scales at d + j * d_stride + b * V.
struct Q8Panels {
  static constexpr int kStep = 1;
  using Scales = Vec;
  const int8_t* q;
  const c10::Half* d;
  int64_t q_stride, d_stride;
  C10_ALWAYS_INLINE void weights(int64_t j, int64_t t, IVec (&w)[kStep]) const {
    w[0] = widen(q + j * q_stride + t * 2 * V);
  }
  C10_ALWAYS_INLINE Vec scales(int64_t j, int64_t b) const {
    return load_scales(d + j * d_stride + b * V);
  }
  // y += float(dot) * (d * s)
  C10_ALWAYS_INLINE static Vec apply(Vec d, Vec dot, Vec s, Vec /*xsum*/, Vec acc) {
    return at::vec::fmadd(dot, d * s, acc);
  }
  Q8Panels group(int64_t first) const {
    return {q + first * q_stride, d + first * d_stride, q_stride, d_stride};
  }
};

// The panels of a pack_q8_weight pack, after checking it and x.
Q8Panels checked_panels(const at::Tensor& x, const at::Tensor& pq, const at::Tensor& pd) {
  TORCH_CHECK_VALUE(pq.dim() == 4 && pq.size(2) == V && pq.size(3) == 2 &&
                        pq.scalar_type() == at::kChar && pq.is_contiguous() && pd.dim() == 3 &&
                        pd.size(0) == pq.size(0) && pd.size(1) * kPairs == pq.size(1) &&
                        pd.size(2) == V && pd.scalar_type() == at::kHalf && pd.is_contiguous(),
                    "packed weight and scales must come from pack_q8_weight on this CPU");
  check_x(x, pd.size(1));
  const int64_t nb = pd.size(1);
  return {pq.data_ptr<int8_t>(), pd.data_ptr<c10::Half>(), nb * kBlock * V, nb * V};
}

}  // namespace

std::vector<at::Tensor> pack_q8_weight(const at::Tensor& qs, const at::Tensor& scales) {
  TORCH_CHECK_VALUE(qs.dim() == 2 && qs.scalar_type() == at::kChar && qs.device().is_cpu(),
                    "qs must be a 2-D int8 CPU tensor, got ", qs.sizes(), " ", qs.scalar_type());
  const int64_t N = qs.size(0), K = qs.size(1), nb = (K + kBlock - 1) / kBlock;
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
  const Q8Panels all = checked_panels(x, packed_q, packed_d);
  return int_dot::linear(x, all, packed_d.size(1), packed_q.size(0), bias, out_features);
}

at::Tensor linear_silu_mul_q8(const at::Tensor& x, const at::Tensor& packed_q,
                              const at::Tensor& packed_d, int64_t intermediate) {
  const Q8Panels all = checked_panels(x, packed_q, packed_d);
  return int_dot::linear_silu_mul(x, all, packed_d.size(1), packed_q.size(0), intermediate);
}
