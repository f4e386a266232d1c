// The decoder-layer stack of engine/models/llama.py in one C++ call: the CPU fast path of
// LlamaModel.forward (engine/models/layer_stack.py builds it and decides when it runs).
//
// Why: at batch-1 decode the kernels of a SmolLM2 step take ~8 ms and the Python around them
// (30 layers x ~9 module calls, attribute lookups, views, Linear's dispatch) ~4 ms. Here each
// layer is the same kernel calls, in the same order, on the same arguments (views included) as
// LlamaDecoderLayer.forward makes through Linear, RMSNorm, apply_rotary, swiglu and
// PagedAttention: every result is the Python path's bits. Whatever Python decides by looking
// at a weight (its kernel, whether SwiGLU fuses) is decided there once and handed in.

#include "cpu_kernels.h"

StackLinear::StackLinear(int64_t kind, at::Tensor weight, int64_t placeholder, at::Tensor pack,
                         c10::optional<at::Tensor> pack_scales, c10::optional<at::Tensor> bias,
                         int64_t out_features)
    : kind(kind),
      weight(std::move(weight)),
      placeholder(placeholder),
      pack(std::move(pack)),
      pack_scales(std::move(pack_scales)),
      bias(std::move(bias)),
      out_features(out_features) {
  TORCH_CHECK_VALUE(kind >= kFloat && kind <= kQ4,
                    "kind must be 0 (float32), 1 (bfloat16), 2 (Q8_0) or 3 (Q4_1), got ", kind);
  TORCH_CHECK_VALUE(kind < kQ8 || this->pack_scales.has_value(),
                    "a quantised linear needs its pack's scales");
}

bool StackLinear::current() const {
  return reinterpret_cast<int64_t>(weight.data_ptr()) == placeholder;
}

// Linear.forward for a 2-D x: the kernel of the weight's pack, x as it is (Python's reshape
// of a 2-D x to [-1, K] is x itself).
at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  switch (kind) {
    case kFloat:
      return linear(x, pack, bias, out_features);
    case kBFloat16:
      return linear_bf16(x, pack, bias, out_features, /*dot=*/true);
    case kQ8:
      return linear_q8(x, pack, *pack_scales, bias, out_features);
    default:
      return linear_q4(x, pack, *pack_scales, bias, out_features);
  }
}

at::Tensor StackLinear::silu_mul(const at::Tensor& x) const {
  const int64_t inter = out_features / 2;
  switch (kind) {
    case kFloat:
      return linear_silu_mul(x, pack, inter);
    case kBFloat16:
      return linear_silu_mul_bf16(x, pack, inter, /*dot=*/true);
    case kQ8:
      return linear_silu_mul_q8(x, pack, *pack_scales, inter);
    default:
      return linear_silu_mul_q4(x, pack, *pack_scales, inter);
  }
}

namespace {

// RMSNorm.forward(h, residual): the fused in-place op where Python takes it (all float32 or
// all bf16, one shape, both contiguous), else residual = h + residual and h = rms_norm(residual).
void add_norm(at::Tensor& h, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const auto dtype = h.scalar_type();
  const bool fused = (dtype == at::kFloat || dtype == at::kBFloat16) &&
                     residual.scalar_type() == dtype && weight.scalar_type() == dtype &&
                     h.sizes() == residual.sizes() && h.is_contiguous() && residual.is_contiguous();
  if (fused) {
    add_rms_norm_(h, residual, weight, eps);
  } else {
    residual = h + residual;
    h = rms_norm(residual, weight, eps);
  }
}

}  // namespace

DecoderStack::DecoderStack(std::vector<StackLayer> layers, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, double scale)
    : layers_(std::move(layers)),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      scale_(scale) {
  TORCH_CHECK_VALUE(!layers_.empty(), "a decoder stack needs at least one layer");
  TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
                    "num_heads, num_kv_heads and head_dim must be positive");
}

bool DecoderStack::current() const {
  for (const auto& layer : layers_) {
    if (!layer.qkv.current() || !layer.o_proj.current() || !layer.gate_up.current() ||
        !layer.down.current()) {
      return false;
    }
  }
  return true;
}

std::vector<at::Tensor> DecoderStack::forward(
    at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
    const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& cu_query_lens, const at::Tensor& seq_lens,
    const std::vector<int64_t>& capture, const c10::optional<at::Tensor>& tree_mask) const {
  TORCH_CHECK_VALUE(kv_caches.size() == layers_.size(), "kv_caches must hold ", layers_.size(),
                    " (k, v) pairs, got ", kv_caches.size());
  TORCH_CHECK_VALUE(h.dim() == 2, "h must be [T, hidden], got ", h.sizes());
  if (!current()) return {};
  const int64_t tokens = h.size(0);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  for (size_t j = 0; j < capture.size(); ++j) {
    TORCH_CHECK_VALUE(capture[j] >= 0 && capture[j] < static_cast<int64_t>(layers_.size()),
                      "capture layer ", capture[j], " is not in [0, ", layers_.size(), ")");
    TORCH_CHECK_VALUE(j == 0 || capture[j] > capture[j - 1], "capture must be ascending");
  }
  at::Tensor residual;  // undefined before the first layer, as Python's None
  std::vector<at::Tensor> captured;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const StackLayer& layer = layers_[i];
    if (!residual.defined()) {
      residual = h;
      h = rms_norm(h, layer.input_norm, layer.input_eps);
    } else {
      add_norm(h, residual, layer.input_norm, layer.input_eps);
    }
    // LlamaAttention.project: one rope call over the query and key heads of the qkv product.
    const at::Tensor qkv = layer.qkv(h);
    at::Tensor qk =
        qkv.narrow(-1, 0, q_size + kv_size).view({tokens, num_heads_ + num_kv_heads_, head_dim_});
    if (layer.q_norm.has_value()) {
      qk = at::cat({rms_norm(qk.narrow(1, 0, num_heads_), *layer.q_norm, layer.q_eps),
                    rms_norm(qk.narrow(1, num_heads_, num_kv_heads_), *layer.k_norm, layer.k_eps)},
                   1);
    }
    const at::Tensor v = qkv.narrow(-1, q_size + kv_size, kv_size)
                             .view({tokens, num_kv_heads_, head_dim_});
    const at::Tensor rotated = rotary(qk, cos, sin);
    const at::Tensor q = rotated.narrow(1, 0, num_heads_);
    const at::Tensor k = rotated.narrow(1, num_heads_, num_kv_heads_);
    // PagedAttention.forward with the step's plans.
    at::Tensor k_cache = std::get<0>(kv_caches[i]), v_cache = std::get<1>(kv_caches[i]);
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping);
    at::Tensor out = at::empty_like(q);
    paged_attention(q, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale_, out,
                    tree_mask);
    h = layer.o_proj(out.reshape({tokens, q_size}));
    add_norm(h, residual, layer.post_norm, layer.post_eps);
    // LlamaMLP: down_proj(swiglu(gate_up_proj, h)).
    h = layer.down(layer.fused_mlp ? layer.gate_up.silu_mul(h) : silu_and_mul(layer.gate_up(h)));
    for (const int64_t c : capture) {
      if (c == static_cast<int64_t>(i)) captured.push_back(h + residual);
    }
  }
  std::vector<at::Tensor> out = {h, residual};
  out.insert(out.end(), captured.begin(), captured.end());
  return out;
}
