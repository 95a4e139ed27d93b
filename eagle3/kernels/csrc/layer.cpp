// decoder_layer: one Llama decoder layer in one call, chaining the other files' entry points in the
// Python modules' order; and the one-row layer: a decode step of one sequence on one-digit GGUF
// codes in one parallel region, for one layer (decoder_layer's one-row case, set_one_region) or a
// forward's layers (LayerStack, RowLayer: which layers it takes), chaining the files' row parts.
// It owns that chaining, linear_any (which linear a packed weight goes to) and how the region's
// threads share the work; LayerWeights is declared in kernels.h, and every op's arithmetic is its
// own file's.
#include "kernels.h"
#include "quant.h"

#include <omp.h>

namespace eagle3 {
namespace {

std::atomic<bool> g_one_region{true};

torch::Tensor linear_any(const torch::Tensor& x, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t out_features, bool bf16, bool amx) {
  const int64_t rows = x.numel() / x.size(-1);
  if (packed.scalar_type() == torch::kByte)   // GGUF codes (pack_quant): fp32 activations
    return linear_quant(x.reshape({rows, x.size(-1)}).contiguous(), packed, bias, out_features);
  auto flat = x.reshape({rows, x.size(-1)}).to(bf16 ? torch::kBFloat16 : torch::kFloat32).contiguous();
  return bf16 ? linear_bf16(flat, packed, bias, out_features, amx) : linear_fp32(flat, packed, bias, out_features);
}


// One input row of a one-digit linear: its bytes, block scales and sums (activation_digits)
struct RowDigits {
  std::vector<int32_t> digits, isum;
  std::vector<float> scale, digit_sum;
  QuantRows rows{};
  void prepare(const float* x, int64_t I) {
    const int64_t nb = I / 32;
    if ((int64_t)scale.size() < nb) {
      digits.resize(nb * kDigitWords), isum.resize(2 * nb), scale.resize(nb), digit_sum.resize(nb);
    }
    activation_digits(x, 1, I, digits.data(), scale.data(), digit_sum.data(), isum.data(), true);
    rows = QuantRows{x, I, nullptr, nb, digits.data(), scale.data(), digit_sum.data(), isum.data()};
  }
};

// this thread's share [lo, hi) of n items among the team's
inline void share_of(int64_t n, int t, int team, int64_t& lo, int64_t& hi) {
  lo = n * t / team;
  hi = n * (t + 1) / team;
}

// y = x @ W^T (+ bias) for this thread's groups of outputs; then, where `residual` is given,
// y + residual for the same outputs (o and down: the layer's h + o, h + d, each one rounding as
// the composite path's add_)
void linear_share(const RowLinear& l, const RowDigits& in, float* y, const float* residual, int t, int team) {
  int64_t g0, g1;
  share_of(l.plan.groups, t, team, g0, g1);
  quant_groups(l.plan, l.base, in.rows, 1, g0, g1, y, false);
  const int64_t O = l.plan.segs.back().out0 + l.plan.segs.back().out;
  const int64_t o0 = std::min(O, g0 * kQuantLanes), o1 = std::min(O, g1 * kQuantLanes);
  if (l.bias)
    for (int64_t o = o0; o < o1; ++o) y[o] = y[o] + l.bias[o];
  if (residual)
    for (int64_t o = o0; o < o1; ++o) y[o] = y[o] + residual[o];
}

// the cache lines of [p, p + bytes) into L1: the small inputs of an op thread 0 runs after the
// linear it starts (norm weights, rotary rows, the cache rows it writes), which the weights
// streamed since the last step have evicted; without this the op waits on memory line by line
inline void warm(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// A one-digit GGUF linear's plan, or false where the one-row layer does not take it
bool row_linear(const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias, int64_t I, int64_t O,
                RowLinear& out) {
  if (packed.scalar_type() != torch::kByte) return false;
  out.plan = quant_plan(packed, I, O);
  if (!out.plan.integer_dots || !out.plan.one_digit) return false;
  out.base = packed.data_ptr<uint8_t>();
  out.bias = nullptr;
  if (bias) {
    if (bias->scalar_type() != torch::kFloat32 || !bias->is_contiguous() || bias->numel() != O) return false;
    out.bias = bias->data_ptr<float>();
  }
  return true;
}

// One layer of one row, run by every thread of the region (its barriers are the team's): the
// composite path's ops in its order, on the same row parts, the small ones on thread 0.
// kp, vp: this layer's cache (one sequence), [Hkv, S, D] at strides ks1/ks2, vs1/vs2.
// next_norm1: the next layer's norm weights (warmed during down), or null.
template <typename KV>
void row_layer(int t, int team, const RowLayer& L, const float* hp, const float* cp, const float* sp, KV* kp,
               KV* vp, int64_t ks1, int64_t ks2, int64_t vs1, int64_t vs2, int64_t start, float* ws,
               float* outp, RowDigits& dg, RowScratch& sc, const float* next_norm1) {
  const LayerWeights& w = L.w;
  const int64_t H = L.H, D = L.D, Hq = w.num_heads, Hkv = w.num_kv_heads, I = w.intermediate;
  const int64_t group = Hq / Hkv, S = start + 1;
  float* x = ws;                           // norm1(h), then norm2(h1)
  float* qkv = x + H;
  float* q = qkv + (Hq + 2 * Hkv) * D;
  float* a = q + Hq * D;
  float* h1 = a + Hq * D;                  // h + o
  float* gu = h1 + H;
  float* sm = gu + 2 * I;
  float* rot = sm + I;
  if (t == 0) {
    rms_norm_row(hp, w.norm1.data_ptr<float>(), (float)w.eps1, H, x);
    dg.prepare(x, H);
  }
#pragma omp barrier
  if (t == 0) {
    warm(cp, D * 4), warm(sp, D * 4);
    for (int64_t g = 0; g < Hkv; ++g)
      warm(kp + g * ks1 + start * ks2, D * sizeof(KV)), warm(vp + g * vs1 + start * vs2, D * sizeof(KV));
  }
  linear_share(L.lin[0], dg, qkv, nullptr, t, team);
#pragma omp barrier
  if (t == 0) rope_row(qkv, cp, sp, Hq, Hkv, D, q, D, kp + start * ks2, ks1, vp + start * vs2, vs1, rot);
#pragma omp barrier
  {   // a share of the query heads each, a kv head's heads together where the share allows
    int64_t lo, hi;
    share_of(Hq, t, team, lo, hi);
    for (int64_t hd = lo; hd < hi;) {
      const int64_t g = hd / group, end = std::min(hi, (g + 1) * group), n = end - hd;
      for (int64_t i = 0; i < n; ++i) {
        sc.qrow[i] = q + (hd + i) * D;
        sc.orow[i] = a + (hd + i) * D;
      }
      lone_row<KV>(n, kp + g * ks1, ks2, vp + g * vs1, vs2, S, D, nullptr, 1.0f / std::sqrt((float)D), nullptr,
                   nullptr, 0, sc);
      hd = end;
    }
  }
#pragma omp barrier
  if (t == 0) dg.prepare(a, Hq * D);
#pragma omp barrier
  if (t == 0) warm(w.norm2.data_ptr<float>(), H * 4);
  linear_share(L.lin[1], dg, h1, hp, t, team);
#pragma omp barrier
  if (t == 0) {
    rms_norm_row(h1, w.norm2.data_ptr<float>(), (float)w.eps2, H, x);
    dg.prepare(x, H);
  }
#pragma omp barrier
  linear_share(L.lin[2], dg, gu, nullptr, t, team);
#pragma omp barrier
  if (t == 0) {
    silu_mul_row(gu, I, sm);
    dg.prepare(sm, I);
  }
#pragma omp barrier
  if (t == 0 && next_norm1) warm(next_norm1, H * 4);
  linear_share(L.lin[3], dg, outp, h1, t, team);
#pragma omp barrier
}

int64_t workspace_floats(const RowLayer& L) {
  const LayerWeights& w = L.w;
  const int64_t D = L.D, Hq = w.num_heads, Hkv = w.num_kv_heads;
  return 2 * L.H + (Hq + 2 * Hkv) * D + 2 * Hq * D + 3 * w.intermediate + D;
}

// the cache element type's pointers of k and v, or an undefined pair
bool row_cache(const torch::Tensor& k, const torch::Tensor& v, int64_t D) {
  return k.scalar_type() == v.scalar_type() &&
         (k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kHalf) && k.stride(-1) == 1 &&
         v.stride(-1) == 1 && k.size(-1) == D && v.size(-1) == D;
}

}  // namespace

void set_one_region(bool on) { g_one_region.store(on); }

bool RowLayer::make(const LayerWeights& w, int64_t H, int64_t D, RowLayer& out) {
  const int64_t Hq = w.num_heads, Hkv = w.num_kv_heads, I = w.intermediate;
  if (w.bf16 || (D != 64 && D != 128) || Hkv <= 0 || Hq % Hkv || H % 32 || (Hq * D) % 32 || I % 32) return false;
  out.w = w, out.H = H, out.D = D;
  return row_linear(w.qkv_w, w.qkv_b, H, (Hq + 2 * Hkv) * D, out.lin[0]) &&
         row_linear(w.o_w, w.o_b, Hq * D, H, out.lin[1]) &&
         row_linear(w.gate_up_w, c10::nullopt, H, 2 * I, out.lin[2]) &&
         row_linear(w.down_w, c10::nullopt, I, H, out.lin[3]);
}

namespace {

// decoder_layer's one-row case (an undefined tensor where it does not apply)
torch::Tensor one_row_layer(const torch::Tensor& h, const LayerWeights& w, const torch::Tensor& cos,
                            const torch::Tensor& sin, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                            int64_t start) {
  RowLayer L;
  const int64_t D = k_buf.size(3);
  if (!RowLayer::make(w, h.size(2), D, L) || k_buf.size(0) != 1 || v_buf.size(0) != 1 || !row_cache(k_buf, v_buf, D) ||
      !cos.is_contiguous() || !sin.is_contiguous() || cos.numel() != D || sin.numel() != D || start < 0 ||
      start + 1 > k_buf.size(2) || start + 1 > v_buf.size(2))
    return {};
  expect(cos, "cos", torch::kFloat32);
  expect(sin, "sin", torch::kFloat32);
  auto out = torch::empty_like(h);
  auto ws = torch::empty({workspace_floats(L)}, h.options());
  static thread_local RowDigits digits;    // filled by thread 0 (this thread), read by the team
  RowDigits& dg = digits;                  // (a thread_local named in the region is each thread's own)
  auto run = [&](auto* kp, auto* vp) {
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
    {
      RowScratch sc(L.w.num_heads / L.w.num_kv_heads);
      row_layer(omp_get_thread_num(), omp_get_num_threads(), L, h.data_ptr<float>(), cos.data_ptr<float>(),
                sin.data_ptr<float>(), kp, vp, k_buf.stride(1), k_buf.stride(2), v_buf.stride(1), v_buf.stride(2),
                start, ws.data_ptr<float>(), out.data_ptr<float>(), dg, sc, nullptr);
    }
  };
  if (k_buf.scalar_type() == torch::kHalf) run(k_buf.data_ptr<at::Half>(), v_buf.data_ptr<at::Half>());
  else run(k_buf.data_ptr<float>(), v_buf.data_ptr<float>());
  return out;
}

}  // namespace

LayerStack::LayerStack(const std::vector<LayerWeights>& weights, int64_t hidden, int64_t head_dim)
    : weights_(weights) {
  layers_.resize(weights_.size());
  applies_ = !weights_.empty();
  for (size_t i = 0; i < weights_.size() && applies_; ++i)
    applies_ = RowLayer::make(weights_[i], hidden, head_dim, layers_[i]);
  if (!applies_) layers_.clear();
}

// h [1, 1, H] fp32; cos, sin [1, 1, 1, D]; k, v the cache [L, 1, Hkv, S, D] (fp32 or fp16, unit
// stride on D); the row goes at index `start`. capture: layer ids whose input h is returned too.
// -> (the last layer's output [1, 1, H], the captured inputs [1, 1, len(capture) * H] or None)
std::tuple<torch::Tensor, c10::optional<torch::Tensor>> LayerStack::decode(
    torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v, int64_t start,
    std::vector<int64_t> capture) const {
  TORCH_CHECK(applies_, "LayerStack.decode: this stack's layers are not all one-digit GGUF codes (see applies)");
  expect(h, "h", torch::kFloat32);
  expect(cos, "cos", torch::kFloat32);
  expect(sin, "sin", torch::kFloat32);
  const int64_t L = (int64_t)layers_.size(), H = layers_[0].H, D = layers_[0].D;
  TORCH_CHECK(h.dim() == 3 && h.numel() == H && h.is_contiguous(), "h must be contiguous [1, 1, ", H, "], got ", h.sizes());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == D && sin.numel() == D,
              "cos, sin must be contiguous [1, 1, 1, ", D, "]");
  TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && k.size(0) == L && v.size(0) == L && k.size(1) == 1 && v.size(1) == 1 &&
              k.size(2) == layers_[0].w.num_kv_heads && v.size(2) == k.size(2) && row_cache(k, v, D),
              "k, v must be the cache [", L, ", 1, Hkv, S, ", D, "] of fp32 or fp16 with unit stride on D, got ",
              k.sizes(), " ", k.scalar_type());
  TORCH_CHECK(start >= 0 && start + 1 <= k.size(3) && start + 1 <= v.size(3), "row ", start, " is outside the cache of ",
              k.size(3));
  for (int64_t c : capture) TORCH_CHECK(c >= 0 && c < L, "capture layer ", c, " outside 0..", L - 1);
  auto out = torch::empty_like(h);
  c10::optional<torch::Tensor> captured;
  if (!capture.empty()) captured = torch::empty({1, 1, (int64_t)capture.size() * H}, h.options());
  int64_t most = 0;
  for (const RowLayer& l : layers_) most = std::max(most, workspace_floats(l));
  auto ws = torch::empty({most + 2 * H}, h.options());
  float* hb[2] = {ws.data_ptr<float>() + most, ws.data_ptr<float>() + most + H};   // layer outputs, in turn
  float* cap = captured ? captured->data_ptr<float>() : nullptr;
  static thread_local RowDigits digits;
  RowDigits& dg = digits;
  auto run = [&](auto* kp, auto* vp) {
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
    {
      const int t = omp_get_thread_num(), team = omp_get_num_threads();
      RowScratch sc(layers_[0].w.num_heads / std::max<int64_t>(1, layers_[0].w.num_kv_heads));
      const float* in = h.data_ptr<float>();
      for (int64_t i = 0; i < L; ++i) {
        if (t == 0)
          for (size_t c = 0; c < capture.size(); ++c)
            if (capture[c] == i) std::memcpy(cap + c * H, in, H * sizeof(float));
        float* o = i + 1 == L ? out.data_ptr<float>() : hb[i % 2];
        row_layer(t, team, layers_[i], in, cos.data_ptr<float>(), sin.data_ptr<float>(), kp + i * k.stride(0),
                  vp + i * v.stride(0), k.stride(2), k.stride(3), v.stride(2), v.stride(3), start, ws.data_ptr<float>(),
                  o, dg, sc, i + 1 < L ? layers_[i + 1].w.norm1.data_ptr<float>() : nullptr);
        in = o;
      }
    }
  };
  if (k.scalar_type() == torch::kHalf) run(k.data_ptr<at::Half>(), v.data_ptr<at::Half>());
  else run(k.data_ptr<float>(), v.data_ptr<float>());
  return {out, captured};
}


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
  if (B * T == 1 && !x_in && !mask && !slot_of_row && g_one_region.load()) {
    auto out = one_row_layer(h, w, cos, sin, k_buf, v_buf, start);
    if (out.defined()) return out;
  }
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
