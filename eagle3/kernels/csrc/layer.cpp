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


// The input rows of a one-digit linear: their bytes, block scales and sums (activation_digits)
struct RowDigits {
  std::vector<int32_t> digits, isum;
  std::vector<float> scale, digit_sum;
  QuantRows rows{};
  void prepare(const float* x, int64_t M, int64_t I) {   // x [M, I]
    const int64_t nb = I / 32;
    if ((int64_t)scale.size() < M * nb) {
      digits.resize(M * nb * kDigitWords), isum.resize(2 * M * nb), scale.resize(M * nb), digit_sum.resize(M * nb);
    }
    activation_digits(x, M, I, digits.data(), scale.data(), digit_sum.data(), isum.data(), true);
    rows = QuantRows{x, I, nullptr, nb, digits.data(), scale.data(), digit_sum.data(), isum.data()};
  }
};

// this thread's share [lo, hi) of n items among the team's
inline void share_of(int64_t n, int t, int team, int64_t& lo, int64_t& hi) {
  lo = n * t / team;
  hi = n * (t + 1) / team;
}

// y [M, O] = x @ W^T (+ bias) for this thread's groups of outputs; then, where `residual` [M, O]
// is given, y + residual for the same outputs (o and down: the layer's h + o, h + d, each one
// rounding as the composite path's add_)
void linear_share(const RowLinear& l, const RowDigits& in, int64_t M, float* y, const float* residual, int t,
                  int team) {
  int64_t g0, g1;
  share_of(l.plan.groups, t, team, g0, g1);
  quant_groups(l.plan, l.base, in.rows, M, g0, g1, y, false);
  const int64_t O = l.plan.segs.back().out0 + l.plan.segs.back().out;
  const int64_t o0 = std::min(O, g0 * kQuantLanes), o1 = std::min(O, g1 * kQuantLanes);
  for (int64_t r = 0; r < M; ++r) {
    float* yr = y + r * O;
    if (l.bias)
      for (int64_t o = o0; o < o1; ++o) yr[o] = yr[o] + l.bias[o];
    if (residual)
      for (int64_t o = o0; o < o1; ++o) yr[o] = yr[o] + residual[r * O + o];
  }
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

// One layer over M rows, run by every thread of the region (its barriers are the team's): the
// composite path's ops in its order, on the same row parts, the small ones on thread 0. kp, vp:
// this layer's cache, [slots, Hkv, S, D] at strides ks/vs. The rows are a block of one sequence
// (slot null: slot 0, written at start.. start + M - 1, seeing keys up to their own; mask [1, 1, M,
// start + M] or null), or rows of several sequences (row r in slot[r] at index[r], seeing keys
// [0, keys[r]) of its slot where the mask [1, 1, M, S] lets it; start unused). job: the
// attention's items for these rows (thread 0 points it at this layer's cache). next_norm1: the
// next layer's norm weights (warmed during down), or null.
template <typename KV>
void row_layer(int t, int team, const RowLayer& L, int64_t M, const float* hp, const float* cp, const float* sp,
               KV* kp, KV* vp, const int64_t (&ks)[3], const int64_t (&vs)[3], int64_t start, const int64_t* slot,
               const int64_t* index, float* ws, float* outp, RowDigits& dg, AttnJob& job, RowScratch& sc,
               const float* next_norm1) {
  const int64_t ks1 = ks[1], ks2 = ks[2], vs1 = vs[1], vs2 = vs[2];
  auto at_row = [&](int64_t r, int64_t& sl, int64_t& ix) {   // row r's slot and cache index
    sl = slot ? slot[r] : 0;
    ix = slot ? index[r] : start + r;
  };
  const LayerWeights& w = L.w;
  const int64_t H = L.H, D = L.D, Hq = w.num_heads, Hkv = w.num_kv_heads, I = w.intermediate;
  const int64_t group = Hq / Hkv, W = (Hq + 2 * Hkv) * D;
  float* x = ws;                           // norm1(h), then norm2(h1): [M, H]
  float* qkv = x + M * H;                  // [M, W]
  float* q = qkv + M * W;                  // [Hq, M, D]
  float* a = q + M * Hq * D;               // [Hq, M, D]
  float* at = a + M * Hq * D;              // a as [M, Hq * D] (blocks of 2+ rows)
  float* h1 = at + M * Hq * D;             // h + o: [M, H]
  float* gu = h1 + M * H;                  // [M, 2I]
  float* sm = gu + M * 2 * I;              // [M, I]
  float* rot = sm + M * I;                 // [D]
  if (t == 0) {
    for (int64_t r = 0; r < M; ++r) rms_norm_row(hp + r * H, w.norm1.data_ptr<float>(), (float)w.eps1, H, x + r * H);
    dg.prepare(x, M, H);
  }
#pragma omp barrier
  if (t == 0) {
    warm(cp, M * D * 4), warm(sp, M * D * 4);
    for (int64_t r = 0; r < M; ++r) {
      int64_t sl, ix;
      at_row(r, sl, ix);
      for (int64_t g = 0; g < Hkv; ++g)
        warm(kp + sl * ks[0] + g * ks1 + ix * ks2, D * sizeof(KV)),
        warm(vp + sl * vs[0] + g * vs1 + ix * vs2, D * sizeof(KV));
    }
  }
  linear_share(L.lin[0], dg, M, qkv, nullptr, t, team);
#pragma omp barrier
  if (t == 0) {
    for (int64_t r = 0; r < M; ++r) {
      int64_t sl, ix;
      at_row(r, sl, ix);
      rope_row(qkv + r * W, cp + r * D, sp + r * D, Hq, Hkv, D, q + r * D, M * D, kp + sl * ks[0] + ix * ks2, ks1,
               vp + sl * vs[0] + ix * vs2, vs1, rot);
    }
    job.kp_ = kp, job.vp_ = vp;
  }
#pragma omp barrier
  if (M == 1) {   // a share of the query heads each, a kv head's heads together where the share allows
    int64_t sl, ix;
    at_row(0, sl, ix);
    const int64_t S = slot ? job.row_keys[0] : start + 1;
    int64_t lo, hi;
    share_of(Hq, t, team, lo, hi);
    for (int64_t hd = lo; hd < hi;) {
      const int64_t g = hd / group, end = std::min(hi, (g + 1) * group), n = end - hd;
      for (int64_t i = 0; i < n; ++i) {
        sc.qrow[i] = q + (hd + i) * D;
        sc.orow[i] = a + (hd + i) * D;
      }
      lone_row<KV>(n, kp + sl * ks[0] + g * ks1, ks2, vp + sl * vs[0] + g * vs1, vs2, S, D, job.mp,
                   1.0f / std::sqrt((float)D), nullptr, nullptr, 0, sc);
      hd = end;
    }
  } else {        // attention's own items, a share each
    int64_t lo, hi;
    share_of((int64_t)job.items.size(), t, team, lo, hi);
    job.run(lo, hi);
  }
#pragma omp barrier
  if (t == 0) {
    const float* in = a;
    if (M > 1) {                           // [Hq, M, D] -> [M, Hq * D], as the composite reshape
      for (int64_t r = 0; r < M; ++r)
        for (int64_t h = 0; h < Hq; ++h) std::memcpy(at + (r * Hq + h) * D, a + (h * M + r) * D, D * sizeof(float));
      in = at;
    }
    dg.prepare(in, M, Hq * D);
  }
#pragma omp barrier
  if (t == 0) warm(w.norm2.data_ptr<float>(), H * 4);
  linear_share(L.lin[1], dg, M, h1, hp, t, team);
#pragma omp barrier
  if (t == 0) {
    for (int64_t r = 0; r < M; ++r) rms_norm_row(h1 + r * H, w.norm2.data_ptr<float>(), (float)w.eps2, H, x + r * H);
    dg.prepare(x, M, H);
  }
#pragma omp barrier
  linear_share(L.lin[2], dg, M, gu, nullptr, t, team);
#pragma omp barrier
  if (t == 0) {
    for (int64_t r = 0; r < M; ++r) silu_mul_row(gu + r * 2 * I, I, sm + r * I);
    dg.prepare(sm, M, I);
  }
#pragma omp barrier
  if (t == 0 && next_norm1) warm(next_norm1, H * 4);
  linear_share(L.lin[3], dg, M, outp, h1, t, team);
#pragma omp barrier
}

int64_t workspace_floats(const RowLayer& L, int64_t M) {
  const LayerWeights& w = L.w;
  const int64_t D = L.D, Hq = w.num_heads, Hkv = w.num_kv_heads;
  return M * (2 * L.H + (Hq + 2 * Hkv) * D + 3 * Hq * D + 3 * w.intermediate) + D;
}

// the attention items of M rows over S_all keys (a block of one sequence: S_all = start + M;
// rows of several: slot and keys of each), not yet pointed at a cache (row_layer does that per
// layer), for a team of `team` threads
AttnJob block_job(const RowLayer& L, int64_t M, int64_t S_all, const bool* mask, bool half, const int64_t (&ks)[3],
                  const int64_t (&vs)[3], float* q, float* a, int team, const int64_t* slot = nullptr,
                  const int64_t* keys = nullptr) {
  AttnJob job;
  job.B = 1, job.Hq = L.w.num_heads, job.T = M, job.D = L.D, job.Hkv = L.w.num_kv_heads, job.S_all = S_all;
  job.rows = slot != nullptr, job.row_slot = slot, job.row_keys = keys;
  job.group = job.Hq / job.Hkv, job.mp = mask, job.qp = q, job.op = a, job.scale = 1.0f / std::sqrt((float)L.D);
  job.half = half;
  for (int i = 0; i < 3; ++i) job.ks[i] = ks[i], job.vs[i] = vs[i];
  if (M > 1) job.build(team);
  return job;
}

// whether k and v are a cache the region reads: one element type (fp32 or fp16), unit stride on D
bool row_cache(const torch::Tensor& k, const torch::Tensor& v, int64_t D) {
  return k.scalar_type() == v.scalar_type() &&
         (k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kHalf) && k.stride(-1) == 1 &&
         v.stride(-1) == 1 && k.size(-1) == D && v.size(-1) == D;
}


// The region: `count` layers over M rows (h [M, H] -> out [M, H]), every layer's cache at
// kp / vp + its index x layer_k / layer_v (strides ks, vs within a layer), rows placed as
// row_layer says (start, or slot / index / keys of each row; the attention sees S_all keys where
// `mask` lets it). capture: layer ids whose input rows go to cap [M, capture.size() * H].
template <typename KV>
void run_region(const RowLayer* layers, int64_t count, int64_t M, const float* h, const float* cp, const float* sp,
                KV* kp, KV* vp, int64_t layer_k, int64_t layer_v, const int64_t (&ks)[3], const int64_t (&vs)[3],
                int64_t start, const int64_t* slot, const int64_t* index, const int64_t* keys, int64_t S_all,
                const bool* mask, const std::vector<int64_t>& capture, float* cap, float* out) {
  const RowLayer& first = layers[0];
  const int64_t H = first.H, D = first.D, nc = (int64_t)capture.size();
  int64_t most = 0;
  for (int64_t i = 0; i < count; ++i) most = std::max(most, workspace_floats(layers[i], M));
  auto ws_t = torch::empty({most + 2 * M * H}, torch::kFloat32);
  float* ws = ws_t.data_ptr<float>();
  float* hb[2] = {ws + most, ws + most + M * H};   // layer outputs, in turn
  static thread_local RowDigits digits;            // filled by thread 0 (this thread), read by the team
  RowDigits& dg = digits;                          // (a thread_local named in the region is each thread's own)
  const int team = std::max(1, at::get_num_threads());
  float* q = ws + M * (H + (first.w.num_heads + 2 * first.w.num_kv_heads) * D);
  AttnJob job = block_job(first, M, S_all, mask, std::is_same_v<KV, at::Half>, ks, vs, q,
                          q + M * first.w.num_heads * D, team, slot, keys);
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    RowScratch sc(first.w.num_heads / first.w.num_kv_heads);
    const float* in = h;
    for (int64_t i = 0; i < count; ++i) {
      if (t == 0)
        for (int64_t c = 0; c < nc; ++c)
          if (capture[c] == i)
            for (int64_t r = 0; r < M; ++r) std::memcpy(cap + (r * nc + c) * H, in + r * H, H * sizeof(float));
      float* o = i + 1 == count ? out : hb[i % 2];
      row_layer(t, n, layers[i], M, in, cp, sp, kp + i * layer_k, vp + i * layer_v, ks, vs, start, slot, index, ws, o,
                dg, job, sc, i + 1 < count ? layers[i + 1].w.norm1.data_ptr<float>() : nullptr);
      in = o;
    }
  }
}

// fn(k's elements, v's elements) as the cache's type (row_cache: fp32 or fp16)
template <typename Fn>
void with_cache(const torch::Tensor& k, const torch::Tensor& v, Fn&& fn) {
  if (k.scalar_type() == torch::kHalf) fn(k.data_ptr<at::Half>(), v.data_ptr<at::Half>());
  else fn(k.data_ptr<float>(), v.data_ptr<float>());
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

// the block's mask as row_layer reads it: null (none), or bool [1, 1, M, S] contiguous; false where
// the region does not take it
bool block_mask(const c10::optional<torch::Tensor>& mask, int64_t M, int64_t S, const bool*& out) {
  out = nullptr;
  if (!mask) return true;
  const torch::Tensor& m = *mask;
  if (m.scalar_type() != torch::kBool || !m.is_contiguous() || m.dim() != 4 || m.size(0) != 1 || m.size(1) != 1 ||
      m.size(2) != M || m.size(3) != S)
    return false;
  out = m.data_ptr<bool>();
  return true;
}

// decoder_layer's case of a block of one sequence (an undefined tensor where it does not apply)
torch::Tensor region_layer(const torch::Tensor& h, const LayerWeights& w, const torch::Tensor& cos,
                           const torch::Tensor& sin, const torch::Tensor& k_buf, const torch::Tensor& v_buf,
                           int64_t start, const c10::optional<torch::Tensor>& mask) {
  RowLayer L;
  const int64_t D = k_buf.size(3), M = h.size(1);
  const bool* mp = nullptr;
  if (h.size(0) != 1 || !RowLayer::make(w, h.size(2), D, L) || k_buf.size(0) != 1 || v_buf.size(0) != 1 ||
      !row_cache(k_buf, v_buf, D) || !cos.is_contiguous() || !sin.is_contiguous() || cos.numel() != M * D ||
      sin.numel() != M * D || start < 0 || start + M > k_buf.size(2) || start + M > v_buf.size(2) ||
      !block_mask(mask, M, start + M, mp))
    return {};
  expect(cos, "cos", torch::kFloat32);
  expect(sin, "sin", torch::kFloat32);
  auto out = torch::empty_like(h);
  const int64_t ks[3] = {k_buf.stride(0), k_buf.stride(1), k_buf.stride(2)};
  const int64_t vs[3] = {v_buf.stride(0), v_buf.stride(1), v_buf.stride(2)};
  with_cache(k_buf, v_buf, [&](auto* kp, auto* vp) {
    run_region(&L, 1, M, h.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), kp, vp, 0, 0, ks, vs,
               start, nullptr, nullptr, nullptr, start + M, mp, {}, nullptr, out.data_ptr<float>());
  });
  return out;
}

}  // namespace

LayerStack::LayerStack(const std::vector<LayerWeights>& weights, int64_t hidden, int64_t head_dim) {
  layers_.resize(weights.size());          // each RowLayer holds its layer's weights
  applies_ = !weights.empty();
  for (size_t i = 0; i < weights.size() && applies_; ++i)
    applies_ = RowLayer::make(weights[i], hidden, head_dim, layers_[i]);
  if (!applies_) layers_.clear();
}

// h [1, M, H] fp32: a block of one sequence, or rows of several; cos, sin [1, 1, M, D]; k, v the
// cache [L, slots, Hkv, S, D] (fp32 or fp16, unit stride on D). One sequence (no slot_of_row): one
// slot, the rows go at start.. start + M - 1, mask None or bool [1, 1, M, start + M]. Rows of
// several (slot_of_row, index_of_row, keys_of_row: int64 [M] each, as attention takes them): row r
// goes to its slot at its index and sees keys [0, keys) there, where the mask [1, 1, M, S] (None:
// all) lets it. capture: layer ids whose input h is returned too.
// -> (the last layer's output [1, M, H], the captured inputs [1, M, len(capture) * H] or None)
std::tuple<torch::Tensor, c10::optional<torch::Tensor>> LayerStack::decode(
    torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v, int64_t start,
    c10::optional<torch::Tensor> mask, std::vector<int64_t> capture, c10::optional<torch::Tensor> slot_of_row,
    c10::optional<torch::Tensor> index_of_row, c10::optional<torch::Tensor> keys_of_row) const {
  TORCH_CHECK(applies_, "LayerStack.decode: this stack's layers are not all one-digit GGUF codes (see applies)");
  expect(h, "h", torch::kFloat32);
  expect(cos, "cos", torch::kFloat32);
  expect(sin, "sin", torch::kFloat32);
  const int64_t L = (int64_t)layers_.size(), H = layers_[0].H, D = layers_[0].D;
  TORCH_CHECK(h.dim() == 3 && h.size(0) == 1 && h.size(2) == H && h.size(1) >= 1 && h.is_contiguous(),
              "h must be contiguous [1, M, ", H, "], got ", h.sizes());
  const int64_t M = h.size(1);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == M * D && sin.numel() == M * D,
              "cos, sin must be contiguous [1, 1, ", M, ", ", D, "]");
  const bool rows = slot_of_row.has_value();
  TORCH_CHECK(rows == index_of_row.has_value() && rows == keys_of_row.has_value(),
              "slot_of_row, index_of_row and keys_of_row go together");
  TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && k.size(0) == L && v.size(0) == L && (rows || k.size(1) == 1) &&
              v.size(1) == k.size(1) && k.size(2) == layers_[0].w.num_kv_heads && v.size(2) == k.size(2) &&
              v.size(3) == k.size(3) && row_cache(k, v, D),
              "k, v must be the cache [", L, ", slots, Hkv, S, ", D, "] (one slot without slot_of_row) of fp32 or fp16 "
              "with unit stride on D, got ", k.sizes(), " ", k.scalar_type());
  const int64_t* slot = nullptr;
  const int64_t* index = nullptr;
  const int64_t* keys = nullptr;
  if (rows) {
    slot = checked_rows(*slot_of_row, "slot_of_row", M, 0, k.size(1) - 1);
    index = checked_rows(*index_of_row, "index_of_row", M, 0, k.size(3) - 1);
    keys = checked_rows(*keys_of_row, "keys_of_row", M, 1, k.size(3));
  } else {
    TORCH_CHECK(start >= 0 && start + M <= k.size(3), "rows ", start, "..", start + M - 1,
                " are outside the cache of ", k.size(3));
  }
  const int64_t S_all = rows ? k.size(3) : start + M;
  const bool* mp = nullptr;
  TORCH_CHECK(block_mask(mask, M, S_all, mp), "mask must be None or a contiguous bool [1, 1, ", M, ", ", S_all, "]");
  for (int64_t c : capture) TORCH_CHECK(c >= 0 && c < L, "capture layer ", c, " outside 0..", L - 1);
  auto out = torch::empty_like(h);
  c10::optional<torch::Tensor> captured;
  if (!capture.empty()) captured = torch::empty({1, M, (int64_t)capture.size() * H}, h.options());
  const int64_t ks[3] = {k.stride(1), k.stride(2), k.stride(3)}, vs[3] = {v.stride(1), v.stride(2), v.stride(3)};
  with_cache(k, v, [&](auto* kp, auto* vp) {
    run_region(layers_.data(), L, M, h.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), kp, vp,
               k.stride(0), v.stride(0), ks, vs, start, slot, index, keys, S_all, mp, capture,
               captured ? captured->data_ptr<float>() : nullptr, out.data_ptr<float>());
  });
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
  if (B == 1 && !x_in && !slot_of_row && g_one_region.load()) {
    auto out = region_layer(h, w, cos, sin, k_buf, v_buf, start, mask);
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
