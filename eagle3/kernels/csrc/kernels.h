// The entry points of the CPU kernels: what bindings.cpp hands to Python (eagle3/kernels/__init__.py
// wraps them) and what layer.cpp chains into one decoder layer. Each is defined, with its shapes and
// rules, in the file named above it; this header owns only the declarations and LayerWeights.
#pragma once

#include "common.h"

namespace eagle3 {

// linear_float.cpp: packed bf16 / fp32 weights (amx: linear_amx.cpp's tiles)
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features, bool amx);
torch::Tensor linear_fp32(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features);

// linear_quant.cpp: GGUF integer codes packed by pack_quant
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                           int64_t out_features);
void set_amx_int8(bool on);      // 4-bit codes of blocks of 8+ rows on AMX-INT8 tiles

// linear_quant_vnni.cpp: vpdpbusd (zmm) retired a second over the parallel region's threads
double integer_dot_peak(int64_t reps);

// linear_amx.cpp: whether the tiles may run here
bool amx_permitted();
bool amx_int8_available();

// norm_rope.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_buf,
                       torch::Tensor v_buf, int64_t start, int64_t Hq, int64_t Hkv,
                       c10::optional<torch::Tensor> slot_of_row = c10::nullopt,
                       c10::optional<torch::Tensor> index_of_row = c10::nullopt);

torch::Tensor silu_mul(torch::Tensor gu);

// attention.cpp
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                        c10::optional<torch::Tensor> slot_of_row = c10::nullopt,
                        c10::optional<torch::Tensor> keys_of_row = c10::nullopt);

// layer.cpp: one decoder layer's packed weights and shapes (built once per layer from Python)

struct LayerWeights {
  torch::Tensor norm1, qkv_w, o_w, norm2, gate_up_w, down_w;   // packed linears (pack_weight)
  c10::optional<torch::Tensor> qkv_b, o_b;
  double eps1 = 0, eps2 = 0;
  int64_t num_heads = 0, num_kv_heads = 0, intermediate = 0;
  bool bf16 = false;
  bool amx = false;              // bf16 linears on AMX tiles (linear_bf16's amx)
};

torch::Tensor decoder_layer(torch::Tensor h, c10::optional<torch::Tensor> x_in, const LayerWeights& w,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor k_buf, torch::Tensor v_buf,
                            int64_t start, c10::optional<torch::Tensor> mask,
                            c10::optional<torch::Tensor> slot_of_row = c10::nullopt,
                            c10::optional<torch::Tensor> index_of_row = c10::nullopt,
                            c10::optional<torch::Tensor> keys_of_row = c10::nullopt);

// threads.cpp
int64_t parallel_threads();

}  // namespace eagle3
