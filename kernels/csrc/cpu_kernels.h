// The C++ CPU kernels behind kernels.cpu_extension (bindings.cpp exposes them to Python).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

// silu(gate) * up, the one formula of silu_and_mul and linear_silu_mul (so the fused GEMM gives
// the two-step path's bits).
inline at::vec::Vectorized<float> silu_mul(at::vec::Vectorized<float> gate,
                                           at::vec::Vectorized<float> up) {
  return gate / (at::vec::Vectorized<float>(1.f) + gate.neg().exp()) * up;
}

// kernels.paged_attention's contract (see kernels/__init__.py); writes out in place.
void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& cu_query_lens,
                     const at::Tensor& seq_lens, double scale, at::Tensor& out);

// weight * x / sqrt(mean(x^2) + eps) over the last dim, float32 (HF's LlamaRMSNorm).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// In place: residual += x, then x = rms_norm(residual) (vLLM's fused_add_rms_norm); the same
// bits as the add followed by rms_norm. x and residual contiguous, of one shape.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);

// x * cos + rotate_half(x) * sin for x [T, H, D] (any token/head strides) and cos/sin [T, D].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// silu(gate) * up for gate_up [T, 2I] = [gate | up]; returns [T, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// kernels.write_kv_cache's contract: key/value [T, Hkv, D] into the caches at slot = block *
// block_size + offset; slot -1 skips the token. Any strides; every slot is checked first.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping);

// A float32 weight [N, K] packed for linear: [ceil(N / V)][K][V], V the SIMD width in floats.
at::Tensor pack_linear_weight(const at::Tensor& weight);

// pack_linear_weight's pack in weight's own memory when its rows fill whole panels (N a
// multiple of V, contiguous): weight then holds the pack and the result is a view of it.
// Otherwise a new tensor, as pack_linear_weight.
at::Tensor pack_linear_weight_(at::Tensor& weight);

// x [M, K] @ weight^T + bias for weight packed by pack_linear_weight; returns [M, out_features].
// out_features must be the weight's row count: the pack pads it to a whole panel.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t out_features);

// silu(gate) * up of x @ gate_up^T for a gate_up weight [2 * intermediate, K] packed by
// pack_linear_weight (intermediate a multiple of the SIMD width); returns [M, intermediate].
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate);
