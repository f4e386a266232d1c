#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python objects: release the GIL so that other Python threads run.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, "Paged causal attention over packed query spans",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("cu_query_lens"), py::arg("seq_lens"), py::arg("scale"), py::arg("out"),
        py::arg("tree_mask") = py::none(), no_gil);
  m.def("write_kv_cache", &write_kv_cache, "Scatter key/value into the paged caches", no_gil);
  m.def("pack_linear_weight", &pack_linear_weight, "Pack a float32 [N, K] weight for linear",
        no_gil);
  m.def("pack_linear_weight_", &pack_linear_weight_,
        "pack_linear_weight in the weight's own memory where its rows fill whole panels", no_gil);
  m.def("linear", &linear, "x @ W^T + b with a packed weight (float32)", no_gil);
  m.def("linear_silu_mul", &linear_silu_mul, "silu(gate) * up of x @ gate_up^T, packed (float32)",
        no_gil);
  m.def("pack_q8_weight", &pack_q8_weight, "Pack an int8 Q8_0 weight and its scales", no_gil);
  m.def("linear_q8", &linear_q8, "x @ W^T + b with a packed int8 weight (float32 x)", no_gil);
  m.def("linear_silu_mul_q8", &linear_silu_mul_q8, "linear_silu_mul with a packed int8 weight",
        no_gil);
  m.def("pack_q4_weight", &pack_q4_weight, "Pack a GGUF Q4_1 weight (q, d, m)", no_gil);
  m.def("linear_q4", &linear_q4, "x @ W^T + b with a packed Q4_1 weight (float32 x)", no_gil);
  m.def("linear_silu_mul_q4", &linear_silu_mul_q4, "linear_silu_mul with a packed Q4_1 weight",
        no_gil);
  m.def("pack_linear_weight_bf16", &pack_linear_weight_bf16,
        "Pack a bfloat16 [N, K] weight for linear_bf16", no_gil);
  m.def("pack_linear_weight_bf16_", &pack_linear_weight_bf16_,
        "pack_linear_weight_bf16 in the weight's own memory where it can", no_gil);
  m.def("linear_bf16", &linear_bf16, "x @ W^T + b with a packed bfloat16 weight", py::arg("x"),
        py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("dot") = true,
        no_gil);
  m.def("linear_silu_mul_bf16", &linear_silu_mul_bf16,
        "silu(gate) * up of x @ gate_up^T, packed bfloat16", py::arg("x"), py::arg("packed"),
        py::arg("intermediate"), py::arg("dot") = true, no_gil);
  m.def("linear_bf16_has_dot", &linear_bf16_has_dot, "Whether linear_bf16 runs AVX512-BF16");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32/bf16)", no_gil);
  m.def("add_rms_norm_", &add_rms_norm_,
        "In place: residual += x, x = RMSNorm(residual) (float32/bf16)", no_gil);
  m.def("rotary", &rotary, "Rotate-half rope of [T, H, D] by cos/sin [T, D] (float32/bf16)",
        no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] (float32/bf16)", no_gil);

  // The decoder-layer stack (cpu_layer_stack.cpp), built once by engine/models/layer_stack.py.
  py::class_<StackLinear>(m, "StackLinear")
      .def(py::init<int64_t, at::Tensor, int64_t, at::Tensor, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, int64_t>(),
           py::arg("kind"), py::arg("weight"), py::arg("placeholder"), py::arg("pack"),
           py::arg("pack_scales"), py::arg("bias"), py::arg("out_features"));
  py::class_<StackLayer>(m, "StackLayer")
      .def(py::init([](at::Tensor input_norm, double input_eps, at::Tensor post_norm,
                       double post_eps, c10::optional<at::Tensor> q_norm, double q_eps,
                       c10::optional<at::Tensor> k_norm, double k_eps, StackLinear qkv,
                       StackLinear o_proj, StackLinear gate_up, StackLinear down,
                       bool fused_mlp) {
             TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(),
                               "q_norm and k_norm come together");
             return StackLayer{std::move(input_norm), std::move(post_norm), input_eps,
                               post_eps,           std::move(q_norm),    std::move(k_norm),
                               q_eps,              k_eps,                std::move(qkv),
                               std::move(o_proj),  std::move(gate_up),   std::move(down),
                               fused_mlp};
           }),
           py::arg("input_norm"), py::arg("input_eps"), py::arg("post_norm"),
           py::arg("post_eps"), py::arg("q_norm"), py::arg("q_eps"), py::arg("k_norm"),
           py::arg("k_eps"), py::arg("qkv"), py::arg("o_proj"), py::arg("gate_up"),
           py::arg("down"), py::arg("fused_mlp"));
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<StackLayer>, int64_t, int64_t, int64_t, double>(),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("scale"))
      .def("current", &DecoderStack::current, "Whether every pack is still its weight's data")
      .def("forward", &DecoderStack::forward,
           "The decoder layers on h: [last MLP output, residual, captured hidden states...], or "
           "[] for a stale pack",
           py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("kv_caches"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("cu_query_lens"),
           py::arg("seq_lens"), py::arg("capture") = std::vector<int64_t>{},
           py::arg("tree_mask") = py::none(), no_gil);
}
