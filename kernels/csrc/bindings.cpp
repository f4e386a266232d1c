#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged causal attention over packed query spans");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32)");
  m.def("rotary", &rotary, "Rotate-half rope of [T, H, D] by cos/sin [T, D] (float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] (float32)");
}
