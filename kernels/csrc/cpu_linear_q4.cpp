// y = x W^T + b on the CPU for a GGUF Q4_1 weight as shipped, float32 x, y and sums.
//
// Q4_1: per output row, blocks of 32 along K, each 32 unsigned 4-bit q (0..15) and two float16
// numbers d and m, w = d * q + m. The GEMM is cpu_int_dot.h's, as for Q8_0 (cpu_linear_q8.cpp's
// file comment says why integers): x quantised per block to int16 (xq, scale s), and per block
//   sum(x * w) = s * (d * sum(xq * q) + m * sum(xq)),
// sum(xq * q) exact in int32 (and in float: below 32 * 32767 * 15 < 2^24), sum(xq) computed once
// per row and block when x is quantised; the float32 result accumulates
// y += s * (d * dot + m * sum(xq)) block by block in k order, from the bias. A row's bits do not
// depend on the number of rows, the tile, the thread count or the SIMD level.
//
// The pack: panels of V output columns, q as [N/V][Kp/4][V][2] uint8 (Kp: K rounded up to a
// whole block, padding q = 0): byte (u, c, e) holds column c's q[4u + e] in its low nibble and
// q[4u + 2 + e] in its high one, so one load of 2V bytes, widened to 2V int16, gives k pair 2u
// (& 0xF) and k pair 2u + 1 (>> 4) of the panel: 0.5 byte a weight. d and m as
// [N/V][Kp/32][2][V] float16 (d then m of a block side by side).

#include "cpu_int_dot.h"

namespace {

using namespace int_dot;

// Q4_1 panels of a group: panel j's k pairs t, t + 1 (t even) at q + j * q_stride + t * V, its
// block b's d at dm + j * dm_stride + b * 2V and m V further on.
struct Q4Panels {
  static constexpr int kStep = 2;
  struct Scales {
    Vec d, m;
  };
  const uint8_t* q;
  const c10::Half* dm;
  int64_t q_stride, dm_stride;
  C10_ALWAYS_INLINE void weights(int64_t j, int64_t t, IVec (&w)[kStep]) const {
    widen_nibbles(q + j * q_stride + t * V, w[0], w[1]);
  }
  C10_ALWAYS_INLINE Scales scales(int64_t j, int64_t b) const {
    const c10::Half* p = dm + j * dm_stride + b * 2 * V;
    return {load_scales(p), load_scales(p + V)};
  }
  // y += s * (d * dot + m * sum(xq))
  C10_ALWAYS_INLINE static Vec apply(const Scales& sc, Vec dot, Vec s, Vec xsum, Vec acc) {
    return at::vec::fmadd(at::vec::fmadd(dot, sc.d, sc.m * xsum), s, acc);
  }
  Q4Panels group(int64_t first) const {
    return {q + first * q_stride, dm + first * dm_stride, q_stride, dm_stride};
  }
};

// The panels of a pack_q4_weight pack, after checking it and x.
Q4Panels checked_panels(const at::Tensor& x, const at::Tensor& pq, const at::Tensor& pdm) {
  TORCH_CHECK_VALUE(pq.dim() == 4 && pq.size(2) == V && pq.size(3) == 2 &&
                        pq.scalar_type() == at::kByte && pq.is_contiguous() && pdm.dim() == 4 &&
                        pdm.size(0) == pq.size(0) && pdm.size(1) * kPairs == 2 * pq.size(1) &&
                        pdm.size(2) == 2 && pdm.size(3) == V && pdm.scalar_type() == at::kHalf &&
                        pdm.is_contiguous(),
                    "packed weight and scales must come from pack_q4_weight on this CPU");
  const int64_t nb = pdm.size(1);
  check_x(x, nb);
  return {pq.data_ptr<uint8_t>(), pdm.data_ptr<c10::Half>(), nb * kBlock * V / 2, nb * 2 * V};
}

// float32 or float16 [N, nb] holding float16 values -> float16.
at::Tensor half_values(const at::Tensor& t, const char* name, int64_t N, int64_t nb) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == N && t.size(1) == nb &&
                        (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) &&
                        t.device().is_cpu(),
                    name, " must be float32 or float16 [", N, ", ", nb, "], got ", t.sizes(), " ",
                    t.scalar_type());
  auto h = t.to(at::kHalf).contiguous();
  TORCH_CHECK_VALUE(h.to(t.scalar_type()).equal(t), name,
                    " must be float16 values (Q4_1 keeps d and m as float16)");
  return h;
}

}  // namespace

std::vector<at::Tensor> pack_q4_weight(const at::Tensor& qs, const at::Tensor& d,
                                       const at::Tensor& m) {
  TORCH_CHECK_VALUE(qs.dim() == 2 && qs.scalar_type() == at::kByte && qs.device().is_cpu(),
                    "qs must be a 2-D uint8 CPU tensor, got ", qs.sizes(), " ", qs.scalar_type());
  const int64_t N = qs.size(0), K = qs.size(1), nb = (K + kBlock - 1) / kBlock;
  const auto q = qs.contiguous();
  TORCH_CHECK_VALUE(q.numel() == 0 || q.max().item<uint8_t>() <= 15,
                    "qs must be 4-bit values in [0, 15]");
  const auto d16 = half_values(d, "d", N, nb), m16 = half_values(m, "m", N, nb);
  const int64_t panels = (N + V - 1) / V;
  auto pq = at::zeros({panels, nb * kBlock / 4, V, 2}, q.options());  // padding: q = d = m = 0
  auto pdm = at::zeros({panels, nb, 2, V}, d16.options());
  const uint8_t* qsrc = q.data_ptr<uint8_t>();
  const c10::Half* dsrc = d16.data_ptr<c10::Half>();
  const c10::Half* msrc = m16.data_ptr<c10::Half>();
  uint8_t* qdst = pq.data_ptr<uint8_t>();
  c10::Half* dmdst = pdm.data_ptr<c10::Half>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < V && p * V + c < N; ++c) {
        const int64_t n = p * V + c;
        for (int64_t k = 0; k < K; ++k) {
          // k = 4u + 2h + e: quad u, nibble h (pair 2u or 2u + 1), parity e
          const int64_t u = k / 4, h = (k / 2) % 2, e = k % 2;
          qdst[((p * nb * kBlock / 4 + u) * V + c) * 2 + e] |= qsrc[n * K + k] << (4 * h);
        }
        for (int64_t b = 0; b < nb; ++b) {
          dmdst[((p * nb + b) * 2) * V + c] = dsrc[n * nb + b];
          dmdst[((p * nb + b) * 2 + 1) * V + c] = msrc[n * nb + b];
        }
      }
    }
  });
  return {pq, pdm};
}

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& packed_q, const at::Tensor& packed_dm,
                     const c10::optional<at::Tensor>& bias, int64_t out_features) {
  const Q4Panels all = checked_panels(x, packed_q, packed_dm);
  return int_dot::linear(x, all, packed_dm.size(1), packed_q.size(0), bias, out_features);
}

at::Tensor linear_silu_mul_q4(const at::Tensor& x, const at::Tensor& packed_q,
                              const at::Tensor& packed_dm, int64_t intermediate) {
  const Q4Panels all = checked_panels(x, packed_q, packed_dm);
  return int_dot::linear_silu_mul(x, all, packed_dm.size(1), packed_q.size(0), intermediate);
}
