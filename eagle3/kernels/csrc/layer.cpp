// decoder_layer: one Llama decoder layer in one call, chaining the other files' entry points in the
// Python modules' order. It owns only that chaining and linear_any (which linear a packed weight
// goes to); LayerWeights is declared in kernels.h, and every op's arithmetic is its own file's.
#include "kernels.h"

namespace eagle3 {
namespace {

torch::Tensor linear_any(const torch::Tensor& x, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t out_features, bool bf16, bool amx) {
  const int64_t rows = x.numel() / x.size(-1);
  if (packed.scalar_type() == torch::kByte)   // GGUF codes (pack_quant): fp32 activations
    return linear_quant(x.reshape({rows, x.size(-1)}).contiguous(), packed, bias, out_features);
  auto flat = x.reshape({rows, x.size(-1)}).to(bf16 ? torch::kBFloat16 : torch::kFloat32).contiguous();
  return bf16 ? linear_bf16(flat, packed, bias, out_features, amx) : linear_fp32(flat, packed, bias, out_features);
}

}  // namespace

// One Llama decoder layer on the kernels, the same ops in the same order as the Python modules
// (RMSNorm.fused, PackedLinear's small-M path, Attention with fused_rope and fused attention, MLP),
// so the result is bit for bit theirs; it saves the ~20 Python-level calls of a layer.
// h [B, T, H] fp32 contiguous -> the layer's output [B, T, H]. w: norm1, qkv, o, norm2, gate_up,
// down (packed), with optional qkv and o biases. x_in: the attention's input when it is not
// norm1(h) (an EAGLE-3 midlayer reads cat(norm(embedding), norm(hidden)) and adds to hidden).
//
// Rows of several sequences (continuous batching): h [1, N, H], k_buf/v_buf [slots, ...] and the
// rows' slot, cache index and key count (int64 [N] each, as rope_qkv and attention take them;
// start unused; mask None, or [1, 1, N, S] over the slots' keys where a block is a tree): the ops
// of FastLayer.forward_rows, bit for bit.
torch::Tensor decoder_layer(torch::Tensor h, c10::optional<torch::Tensor> x_in, const LayerWeights& w,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor k_buf, torch::Tensor v_buf,
                            int64_t start, c10::optional<torch::Tensor> mask,
                            c10::optional<torch::Tensor> slot_of_row,
                            c10::optional<torch::Tensor> index_of_row,
                            c10::optional<torch::Tensor> keys_of_row) {
  expect(h, "h", torch::kFloat32);
  TORCH_CHECK(h.dim() == 3 && h.is_contiguous(), "h must be contiguous [B, T, H], got ", h.sizes());
  TORCH_CHECK(k_buf.dim() == 4, "k_buf must be [B, Hkv, S, D], got ", k_buf.sizes());
  const int64_t B = h.size(0), T = h.size(1), H = h.size(2), D = k_buf.size(3);
  if (x_in) {
    expect(*x_in, "x_in", torch::kFloat32);
    TORCH_CHECK(x_in->dim() == 3 && x_in->size(0) == B && x_in->size(1) == T,
                "x_in ", x_in->sizes(), " must be [B, T, *] with h's B, T = ", B, ", ", T);
  }
  TORCH_CHECK(cos.dim() == 4 && cos.size(0) == B && cos.size(2) == T,
              "cos ", cos.sizes(), " must be [B, 1, T, D] with h's B, T = ", B, ", ", T);
  const int64_t end = start + T, Hq = w.num_heads, Hkv = w.num_kv_heads, I = w.intermediate;
  auto x = x_in ? *x_in : rms_norm(h, w.norm1, w.eps1);
  auto qkv = linear_any(x, w.qkv_w, w.qkv_b, (Hq + 2 * Hkv) * D, w.bf16, w.amx);
  torch::Tensor a;
  if (slot_of_row) {
    TORCH_CHECK(index_of_row && keys_of_row && B == 1 && !x_in,
                "rows of several sequences: h [1, N, H], slot, index and keys of each row, no x_in");
    auto q = rope_qkv(qkv, cos, sin, k_buf, v_buf, 0, Hq, Hkv, slot_of_row, index_of_row);
    c10::optional<torch::Tensor> m;
    if (mask) m = mask->contiguous();
    a = attention(q, k_buf, v_buf, m, slot_of_row, keys_of_row);
  } else {
    auto q = rope_qkv(qkv, cos, sin, k_buf, v_buf, start, Hq, Hkv);
    c10::optional<torch::Tensor> m;
    if (mask) m = mask->contiguous();
    a = attention(q, k_buf.narrow(2, 0, end), v_buf.narrow(2, 0, end), m);
  }
  auto o = linear_any(a.transpose(1, 2).reshape({B, T, Hq * D}), w.o_w, w.o_b, H, w.bf16, w.amx);
  h = o.view({B, T, H}).add_(h);                      // h + o, in o's own storage
  x = rms_norm(h, w.norm2, w.eps2);
  auto gu = linear_any(x, w.gate_up_w, c10::nullopt, 2 * I, w.bf16, w.amx).view({B, T, 2 * I});
  auto d = linear_any(silu_mul(gu), w.down_w, c10::nullopt, H, w.bf16, w.amx);
  return d.view({B, T, H}).add_(h);                   // h + d: the same sum, no new tensor
}

}  // namespace eagle3
