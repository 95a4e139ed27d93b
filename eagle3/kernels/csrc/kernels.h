// The entry points of the CPU kernels: what bindings.cpp hands to Python (eagle3/kernels/__init__.py
// wraps them) and what layer.cpp chains into one decoder layer. Each is defined, with its shapes and
// rules, in the file named above it; this header owns only the declarations and LayerWeights.
#pragma once

#include "common.h"
#include "quant.h"

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

// ---- row parts: the entry points' arithmetic on raw rows, which the one-row layer (layer.cpp)
// runs inside its one parallel region, so it gets their bits
// norm_rope.cpp: one row of rms_norm; rope_qkv's rotary and cache write of one row (q heads at
// q + h * q_stride, kv head h's k and v at k + h * k_stride, v + h * v_stride; rot: D floats of
// scratch); silu_mul of one row (g: gate | up, 2I floats)
void rms_norm_row(const float* x, const float* w, float eps, int64_t H, float* y);
template <typename KV>
void rope_row(const float* src, const float* c, const float* sn, int64_t Hq, int64_t Hkv, int64_t D,
              float* q, int64_t q_stride, KV* k, int64_t k_stride, KV* v, int64_t v_stride, float* rot);
void silu_mul_row(const float* g, int64_t I, float* out);

// attention.cpp: a lone query row's heads of one kv head (attention's single-row item)
struct RowScratch {
  explicit RowScratch(int64_t heads) : mx(heads), sum(heads), inv(heads), qrow(heads), prow(heads), orow(heads) {}
  std::vector<float> sc, mx, sum, inv, acc;
  std::vector<const float*> qrow, prow;   // qrow: the heads' queries, set by the caller
  std::vector<float*> orow;               // the heads' outputs, set by the caller
};
template <typename KV>
void lone_row(int64_t heads, const KV* kb, int64_t ldk, const KV* vb, int64_t ldv, int64_t S, int64_t D,
              const bool* mr, float scale, const KV* nk, const KV* nv, int64_t nS, RowScratch& s);

// attention.cpp: one call's work, as items a thread runs any share of (attention runs them with
// at::parallel_for; the one-row layer's region gives each thread its share). q, out [B, Hq, T, D]
// contiguous; k, v [B or slots, Hkv, S_all, D] fp32 or fp16 (half) at strides ks, vs; mask as
// attention's (mp, mask_b: its batch stride), rows: slot_of_row and keys_of_row.
struct AttnItem { int64_t b, g, t0, n, h0 = 0, hn = 0; };
struct AttnJob {
  int64_t B = 0, Hq = 0, T = 0, D = 0, Hkv = 0, S_all = 0, group = 0;
  bool rows = false, half = false;
  const int64_t* row_slot = nullptr;
  const int64_t* row_keys = nullptr;
  const bool* mp = nullptr;
  int64_t mask_b = 0;
  const float* qp = nullptr;
  float* op = nullptr;
  float scale = 0.0f;
  const void* kp_ = nullptr;
  const void* vp_ = nullptr;
  int64_t ks[3] = {0, 0, 0}, vs[3] = {0, 0, 0};
  std::vector<AttnItem> items;
  void build(int64_t threads);               // the items, for a team of `threads`
  void run(int64_t r0, int64_t r1) const;     // items [r0, r1)
};

// layer.cpp: one decoder layer's packed weights and shapes (built once per layer from Python)

struct LayerWeights {
  torch::Tensor norm1, qkv_w, o_w, norm2, gate_up_w, down_w;   // packed linears (pack_weight)
  c10::optional<torch::Tensor> qkv_b, o_b;
  double eps1 = 0, eps2 = 0;
  int64_t num_heads = 0, num_kv_heads = 0, intermediate = 0;
  bool bf16 = false;
  bool amx = false;              // bf16 linears on AMX tiles (linear_bf16's amx)
};


// The one-row layer: a decode step of one sequence through layers whose linears are all one-digit
// GGUF codes, in one parallel region (decoder_layer takes it for one layer; LayerStack for a
// forward's layers in one region). Same bits as the composite call.
void set_one_region(bool on);    // decoder_layer's one-row case on (default) or off

struct RowLinear {
  QuantPlan plan;
  const uint8_t* base = nullptr;
  const float* bias = nullptr;     // null: none
};

struct RowLayer {
  LayerWeights w;
  RowLinear lin[4];                // qkv, o, gate_up, down
  int64_t H = 0, D = 0;
  // false where the one-row layer does not take these weights (not all one-digit codes, bf16, a
  // head_dim other than 64 or 128, widths not multiples of 32)
  static bool make(const LayerWeights& w, int64_t H, int64_t D, RowLayer& out);
};

class LayerStack {
 public:
  LayerStack(const std::vector<LayerWeights>& weights, int64_t hidden, int64_t head_dim);
  bool applies() const { return applies_; }
  std::tuple<torch::Tensor, c10::optional<torch::Tensor>> decode(torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                                                                torch::Tensor k, torch::Tensor v, int64_t start,
                                                                c10::optional<torch::Tensor> mask,
                                                                std::vector<int64_t> capture,
                                                                c10::optional<torch::Tensor> slot_of_row,
                                                                c10::optional<torch::Tensor> index_of_row,
                                                                c10::optional<torch::Tensor> keys_of_row) const;

 private:
  std::vector<RowLayer> layers_;
  bool applies_ = false;
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
