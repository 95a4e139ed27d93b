// The Python module (PYBIND11_MODULE) and nothing else: it owns each entry point's Python name,
// its arguments' names and defaults, and LayerWeights' keyword-only constructor; the functions are
// kernels.h's. eagle3/kernels/__init__.py loads the module and hands the functions out.
#include <torch/extension.h>

#include "kernels.h"

using namespace eagle3;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "small-M linear: packed bf16 weight, bf16 x, fp32 out (amx: on AMX tiles)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("amx") = false);
  m.def("amx_int8_available", &amx_int8_available, "whether this CPU has AMX-INT8 and the tiles are granted");
  m.def("set_amx_int8", &set_amx_int8,
        "4-bit codes of blocks of >= 8 rows on AMX-INT8 tiles (same bits as the VNNI path)");
  m.def("amx_permitted", &amx_permitted, "whether this process may use AMX tiles (Linux grants them per process)");
  m.def("linear_fp32", &linear_fp32, "small-M linear: packed fp32 weight and x");
  m.def("linear_quant", &linear_quant, "small-M linear: GGUF codes packed by pack_quant, fp32 x and out");
  m.def("rms_norm", &rms_norm, "row-stable RMSNorm, fp32");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up block [.., 2I] -> [.., I], fp32");
  m.def("attention", &attention, "row-stable GQA attention over a cache prefix, fp32", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("slot_of_row") = py::none(),
        py::arg("keys_of_row") = py::none());
  py::class_<LayerWeights>(m, "LayerWeights", py::module_local(), "one decoder layer's packed weights and shapes")
      .def(py::init([](torch::Tensor norm1, torch::Tensor qkv_w, c10::optional<torch::Tensor> qkv_b,
                       torch::Tensor o_w, c10::optional<torch::Tensor> o_b, torch::Tensor norm2,
                       torch::Tensor gate_up_w, torch::Tensor down_w, double eps1, double eps2,
                       int64_t num_heads, int64_t num_kv_heads, int64_t intermediate, bool bf16, bool amx) {
             return LayerWeights{norm1, qkv_w, o_w, norm2, gate_up_w, down_w, qkv_b, o_b,
                                 eps1, eps2, num_heads, num_kv_heads, intermediate, bf16, amx};
           }),
           py::kw_only(), py::arg("norm1"), py::arg("qkv_w"), py::arg("qkv_b"), py::arg("o_w"),
           py::arg("o_b"), py::arg("norm2"), py::arg("gate_up_w"), py::arg("down_w"), py::arg("eps1"),
           py::arg("eps2"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("intermediate"),
           py::arg("bf16"), py::arg("amx") = false);
  m.def("decoder_layer", &decoder_layer, "one Llama decoder layer on the kernels (bits of the Python path)",
        py::arg("h"), py::arg("x_in"), py::arg("weights"), py::arg("cos"), py::arg("sin"),
        py::arg("k_buf"), py::arg("v_buf"), py::arg("start"), py::arg("mask"),
        py::arg("slot_of_row") = py::none(), py::arg("index_of_row") = py::none(),
        py::arg("keys_of_row") = py::none());
  py::class_<LayerStack>(m, "LayerStack", py::module_local(),
                         "a forward's decoder layers for one-row decode steps in one parallel region")
      .def(py::init<const std::vector<LayerWeights>&, int64_t, int64_t>(), py::arg("layers"), py::arg("hidden"),
           py::arg("head_dim"))
      .def_property_readonly("applies", &LayerStack::applies)
      .def("decode", &LayerStack::decode, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("k"), py::arg("v"),
           py::arg("start"), py::arg("mask"), py::arg("capture"), py::arg("slot_of_row") = py::none(),
           py::arg("index_of_row") = py::none(), py::arg("keys_of_row") = py::none());
  m.def("set_one_region", &set_one_region,
        "a one-row decoder layer on one-digit GGUF codes in one parallel region (same bits; default on)");
  m.def("parallel_threads", &parallel_threads, "threads that ran a parallel region");
  m.def("integer_dot_peak", &integer_dot_peak, "vpdpbusd (zmm) retired a second over the threads",
        py::arg("reps") = 20000000);
  m.def("rope_qkv", &rope_qkv, "rotary q/k of a fused qkv block, k/v written into the cache, fp32",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_buf"), py::arg("v_buf"), py::arg("start"),
        py::arg("Hq"), py::arg("Hkv"), py::arg("slot_of_row") = py::none(), py::arg("index_of_row") = py::none());
}
