// The C++ CPU kernels behind kernels.cpu_extension (bindings.cpp exposes them to Python).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <type_traits>

// silu(gate) * up, the one formula of silu_and_mul and linear_silu_mul (so the fused GEMM gives
// the two-step path's bits).
inline at::vec::Vectorized<float> silu_mul(at::vec::Vectorized<float> gate,
                                           at::vec::Vectorized<float> up) {
  return gate / (at::vec::Vectorized<float>(1.f) + gate.neg().exp()) * up;
}

// fn(std::integral_constant<int, R>, first row) over rows [0, M) for the GEMMs' row tiles:
// tiles of RMax rows, then (with Halves) of RMax / 2, then of 2 and of 1 for the rest. A row's
// result does not depend on the tile it falls in.
template <int RMax, bool Halves, typename Fn>
void row_tiles(int64_t M, const Fn& fn) {
  int64_t i = 0;
  for (; i + RMax <= M; i += RMax) fn(std::integral_constant<int, RMax>{}, i);
  if constexpr (Halves && RMax > 2) {
    for (; i + RMax / 2 <= M; i += RMax / 2) fn(std::integral_constant<int, RMax / 2>{}, i);
  }
  if constexpr (RMax > 2) {
    for (; i + 2 <= M; i += 2) fn(std::integral_constant<int, 2>{}, i);
  }
  for (; i < M; ++i) fn(std::integral_constant<int, 1>{}, i);
}

// Up to kSmallRows rows (a decode step, the verification of a few drafts) a GEMM takes all rows
// as one tile, so that the weight streams past them once. Split into row tiles (3 = 2 + 1
// rows), each tile re-reads the panels while the memory bus idles: on the AVX2 dev CPU 3 rows
// took 1.13-1.15x the time of 1 through the float32 LM head and gate_up, 1.01-1.04x as one
// tile. Such a tile takes fewer panels where the registers need it.
constexpr int kSmallRows = at::vec::Vectorized<float>::size() >= 16 ? 8 : 6;
constexpr int kVecRegs = at::vec::Vectorized<float>::size() >= 16 ? 32 : 16;

// Panels a tile of `rows` rows keeps in registers, at most `cap`: rows * P * sums accumulators
// (`sums` per row and panel) + P * loads weight vectors + 1 broadcast x; 0 if not even one.
constexpr int small_tile_panels(int rows, int sums, int loads, int cap) {
  const int p = (kVecRegs - 1) / (rows * sums + loads);
  return p < cap ? p : cap;
}

// fn(std::integral_constant<int, M>) for 1 <= M <= kSmallRows.
template <int R = 1, typename Fn>
void with_small_rows(int64_t M, const Fn& fn) {
  if constexpr (R < kSmallRows) {
    if (M != R) return with_small_rows<R + 1>(M, fn);
  }
  fn(std::integral_constant<int, R>{});
}

// The row tiling of a call of R <= kSmallRows rows: one tile (row_tiles' interface).
template <int R>
struct OneTile {
  template <typename Fn>
  void operator()(int64_t, const Fn& fn) const {
    fn(std::integral_constant<int, R>{}, 0);
  }
};

// run(panels per tile P, row tiling) for a call of M rows of a GEMM whose tiles hold Sums
// accumulators per (row, panel) and Loads weight vectors per panel: up to kSmallRows rows, one
// tile of them all with as many panels as the registers hold (at most Cap), where one fits;
// otherwise tiles of Cap panels and row_tiles<RMax, Halves>.
template <int Sums, int Loads, int Cap, int RMax, bool Halves, typename Run>
void by_row_count(int64_t M, const Run& run) {
  const auto tiled = [&] {
    run(std::integral_constant<int, Cap>{},
        [](int64_t rows, const auto& fn) { row_tiles<RMax, Halves>(rows, fn); });
  };
  if (M < 1 || M > kSmallRows) return tiled();
  with_small_rows(M, [&](auto all_rows) {
    constexpr int R = decltype(all_rows)::value;
    constexpr int P = small_tile_panels(R, Sums, Loads, Cap);
    if constexpr (P > 0) {
      run(std::integral_constant<int, P>{}, OneTile<R>{});
    } else {
      tiled();
    }
  });
}

// kernels.paged_attention's contract (see kernels/__init__.py); writes out in place.
void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& cu_query_lens,
                     const at::Tensor& seq_lens, double scale, at::Tensor& out,
                     const c10::optional<at::Tensor>& tree_mask = c10::nullopt);

// weight * x / sqrt(mean(x^2) + eps) over the last dim, float32 or bf16 (HF's LlamaRMSNorm;
// the layer ops below take either dtype, one for all their tensors).
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

// Int8-weight linear (cpu_linear_q8.cpp): a weight quantised as GGUF Q8_0 (per row, blocks of 32
// along K, w = d * q) given as qs int8 [N, K] and d [N, ceil(K / 32)] (float16 values, as float32
// or float16), packed into panels: returns {q [ceil(N / V)][Kp / 2][V][2] int8 (Kp: K rounded up
// to a block), d [ceil(N / V)][Kp / 32][V] float16}.
std::vector<at::Tensor> pack_q8_weight(const at::Tensor& qs, const at::Tensor& scales);

// x [M, K] float32 @ dequant(weight)^T + bias for a weight packed by pack_q8_weight: x quantised
// per block to int16, integer block dot products, float32 sums.
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& packed_q, const at::Tensor& packed_d,
                     const c10::optional<at::Tensor>& bias, int64_t out_features);

// linear_silu_mul for a gate_up weight packed by pack_q8_weight.
at::Tensor linear_silu_mul_q8(const at::Tensor& x, const at::Tensor& packed_q,
                              const at::Tensor& packed_d, int64_t intermediate);

// GGUF Q4_1 weight-only linear (cpu_linear_q4.cpp): per row, blocks of 32 along K, w = d * q + m
// with q in [0, 15], given as qs uint8 [N, K] and d, m float16 values (float32 or float16)
// [N, ceil(K / 32)], packed into panels: returns {q [ceil(N / V)][ceil(K / 32) * 8][V][2] uint8
// (two 4-bit q a byte), dm [ceil(N / V)][ceil(K / 32)][2][V] float16}.
std::vector<at::Tensor> pack_q4_weight(const at::Tensor& qs, const at::Tensor& d,
                                       const at::Tensor& m);

// x [M, K] @ dequant(weight)^T + bias for a weight packed by pack_q4_weight (float32 sums).
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& packed_q, const at::Tensor& packed_dm,
                     const c10::optional<at::Tensor>& bias, int64_t out_features);

// linear_silu_mul for a gate_up weight packed by pack_q4_weight.
at::Tensor linear_silu_mul_q4(const at::Tensor& x, const at::Tensor& packed_q,
                              const at::Tensor& packed_dm, int64_t intermediate);

// cpu_linear_bf16.cpp: a bfloat16 weight [N, K] packed for linear_bf16 as
// [ceil(N / 16)][ceil(K / 2)][16][2] (k in pairs; padding 0), the same at every SIMD level.
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight);

// pack_linear_weight_bf16's pack in weight's own memory when N is a multiple of 16, K even and
// weight contiguous (the result is then a view of it); otherwise a new tensor.
at::Tensor pack_linear_weight_bf16_(at::Tensor& weight);

// x [M, K] (bf16 or float32) @ weight^T + bias for a pack of pack_linear_weight_bf16, summed in
// float32 and returned in x's dtype; dot: use AVX512-BF16 where compiled and the CPU has it.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features, bool dot);

// silu(gate) * up of x @ gate_up^T for a gate_up pack of pack_linear_weight_bf16
// (intermediate a multiple of 16), as linear_bf16; returns [M, intermediate].
at::Tensor linear_silu_mul_bf16(const at::Tensor& x, const at::Tensor& packed,
                                int64_t intermediate, bool dot);

// Whether linear_bf16 can run AVX512-BF16 here (the build and the CPU).
bool linear_bf16_has_dot();

// cpu_layer_stack.cpp: the decoder layers of engine/models/llama.py run in one call (the CPU
// fast path of LlamaModel.forward), calling the kernels above in the order and with the
// arguments the Python layers use, so the results are the same bits.

// One Linear as Linear.forward runs it on its packed or quantised weight. `weight` is the
// Parameter itself (not a copy: a new `.data` in Python shows here), `placeholder` the address
// its data had when the pack was made: the pack is current while the two agree.
struct StackLinear {
  // linear, linear_bf16, linear_q8, linear_q4
  enum Kind : int64_t { kFloat = 0, kBFloat16 = 1, kQ8 = 2, kQ4 = 3 };
  StackLinear(int64_t kind, at::Tensor weight, int64_t placeholder, at::Tensor pack,
              c10::optional<at::Tensor> pack_scales, c10::optional<at::Tensor> bias,
              int64_t out_features);
  bool current() const;
  at::Tensor operator()(const at::Tensor& x) const;
  // silu(gate) * up of this gate_up projection in one call (swiglu's fused path).
  at::Tensor silu_mul(const at::Tensor& x) const;

  int64_t kind;
  at::Tensor weight;
  int64_t placeholder;
  at::Tensor pack;
  c10::optional<at::Tensor> pack_scales;  // Q8_0: the second tensor of q8_weight()
  c10::optional<at::Tensor> bias;
  int64_t out_features;
};

// One LlamaDecoderLayer. q_norm/k_norm: qwen3's per-head RMSNorm of q and k before rope
// (absent: none). fused_mlp: swiglu's one-call path (else the gate_up product, then
// silu_and_mul), decided in Python by engine.models.layers.swiglu_fuses.
struct StackLayer {
  at::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  c10::optional<at::Tensor> q_norm, k_norm;
  double q_eps, k_eps;
  StackLinear qkv, o_proj, gate_up, down;
  bool fused_mlp;
};

class DecoderStack {
 public:
  DecoderStack(std::vector<StackLayer> layers, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double scale);
  // Whether every layer's packs are still the Parameters' data.
  bool current() const;
  // h [T, hidden] (the embeddings; written in place, as the Python layers do) -> {the last MLP
  // output, the residual stream}: the Python loop's (h, residual). cos/sin [T, head_dim]; the
  // attention metadata as cpu_attention's plans hold them. Empty when a pack is stale (nothing
  // has run then: the caller rebuilds the stack or takes the Python path). Then, for each
  // layer index in `capture` (ascending), the hidden state after that layer (h + residual).
  // tree_mask: paged_attention's.
  std::vector<at::Tensor> forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                  const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
                                  const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                  const at::Tensor& cu_query_lens, const at::Tensor& seq_lens,
                                  const std::vector<int64_t>& capture,
                                  const c10::optional<at::Tensor>& tree_mask) const;

 private:
  std::vector<StackLayer> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
};
