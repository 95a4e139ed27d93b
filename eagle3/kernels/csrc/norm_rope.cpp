// The row-wise fp32 steps around a layer's linears and attention, each row in one fixed order:
//   rms_norm:  y = x / sqrt(mean(x^2) + eps) * w, per row of [N, H]
//   rope_qkv:  the rotary embedding of a fused qkv block (HF's rotate-half), q returned, k and v
//              written into the cache, rounded as torch's composite ops round
//   silu_mul:  the MLP's silu(gate) * up from the fused gate_up block [N, 2I] -> [N, I], each
//              element on its own (e^x by exp_neg: within a few ulp of torch's silu, not its bits)
// Each has a row part (rms_norm_row, rope_row, silu_mul_row) that the entry point runs per row and
// the one-row layer (layer.cpp) runs in its region. It does not own attention (attention.cpp) nor
// the linears.
#include "kernels.h"

namespace eagle3 {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

void rms_norm_row(const float* x, const float* w, float eps, int64_t H, float* y) {
  const float scale = 1.0f / std::sqrt(dot(x, x, H) / (float)H + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = x[i] * scale * w[i];
}

template <typename KV>
void rope_row(const float* src, const float* c, const float* sn, int64_t Hq, int64_t Hkv, int64_t D,
              float* q, int64_t q_stride, KV* k, int64_t k_stride, KV* v, int64_t v_stride, float* rot) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < Hq + 2 * Hkv; ++h) {
    const float* x = src + h * D;
    if (h >= Hq + Hkv) {
      KV* dst = v + (h - Hq - Hkv) * v_stride;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<KV>(x[d]);
      continue;
    }
    float* dst = h < Hq ? q + h * q_stride : rot;
    for (int64_t d = 0; d < half; ++d) {
      const float a = x[d] * c[d], e = -x[d + half] * sn[d];
      dst[d] = a + e;
    }
    for (int64_t d = half; d < D; ++d) {
      const float a = x[d] * c[d], e = x[d - half] * sn[d];
      dst[d] = a + e;
    }
    if (h >= Hq) {
      KV* kd = k + (h - Hq) * k_stride;
      for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<KV>(rot[d]);
    }
  }
}

template void rope_row<float>(const float*, const float*, const float*, int64_t, int64_t, int64_t, float*,
                              int64_t, float*, int64_t, float*, int64_t, float*);
template void rope_row<at::Half>(const float*, const float*, const float*, int64_t, int64_t, int64_t, float*,
                                 int64_t, at::Half*, int64_t, at::Half*, int64_t, float*);

void silu_mul_row(const float* g, int64_t I, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  const float* u = g + I;
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = I - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
    const __m512 e = exp_neg(_mm512_or_ps(x, sign));              // e^-|x|
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(one, neg, e), _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_maskz_loadu_ps(m, u + i)));
  }
}

// x [N, H] fp32 contiguous, w [H] fp32 -> [N, H]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  expect(x, "x", torch::kFloat32);
  expect(w, "weight", torch::kFloat32);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(-1), "contiguous x [.., H], w [H]");
  const int64_t H = x.size(-1), N = x.numel() / H;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * H, wp, (float)eps, H, yp + r * H);
  });
  return y;
}

// qkv [B*T, (Hq + 2 Hkv) * D] fp32 contiguous (rows b-major); cos, sin [B, 1, T, D] fp32
// contiguous (HF's rotate-half tables); k_buf, v_buf [B, Hkv, S, D] fp32 with unit stride on D.
// Rotates q and k, writes k and v into rows start..start+T of the buffers and returns q as
// [B, Hq, T, D]. Each element is x*cos + rotate_half(x)*sin rounded as torch rounds it (two
// products, one sum; the build has no FMA contraction), so it equals the composite torch path bit
// for bit and a row never depends on the others.
// Rows of several sequences (continuous batching): B = 1, T = N rows, k_buf/v_buf [slots, ...];
// row t's k/v go to slot slot_of_row[t], cache row index_of_row[t] (int64 [N] each; start unused).
torch::Tensor rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_buf,
                       torch::Tensor v_buf, int64_t start, int64_t Hq, int64_t Hkv,
                       c10::optional<torch::Tensor> slot_of_row,
                       c10::optional<torch::Tensor> index_of_row) {
  expect(qkv, "qkv", torch::kFloat32);
  expect(cos, "cos", torch::kFloat32);
  expect(sin, "sin", torch::kFloat32);
  expect_kv(k_buf, v_buf);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "qkv [B*T, W], cos/sin [B, 1, T, D] contiguous");
  TORCH_CHECK(cos.dim() == 4 && cos.size(1) == 1 && cos.sizes() == sin.sizes(), "cos/sin must be [B, 1, T, D]");
  const int64_t B = cos.size(0), T = cos.size(2), D = cos.size(3);
  TORCH_CHECK(D % 2 == 0, "head_dim ", D, " must be even");
  TORCH_CHECK(qkv.size(0) == B * T && qkv.size(1) == (Hq + 2 * Hkv) * D,
              "qkv [", qkv.size(0), ", ", qkv.size(1), "] != [B*T, (Hq + 2 Hkv) * D] = [", B * T, ", ",
              (Hq + 2 * Hkv) * D, "]");
  const bool rows = slot_of_row.has_value();
  TORCH_CHECK(rows == index_of_row.has_value() && (!rows || B == 1), "slot_of_row and index_of_row go together, with B = 1");
  const int64_t* row_slot = rows ? checked_rows(*slot_of_row, "slot_of_row", T, 0, k_buf.size(0) - 1) : nullptr;
  const int64_t* row_index = rows ? checked_rows(*index_of_row, "index_of_row", T, 0, k_buf.size(2) - 1) : nullptr;
  TORCH_CHECK(k_buf.dim() == 4 && v_buf.dim() == 4 && (rows || (k_buf.size(0) == B && v_buf.size(0) == B)) &&
              v_buf.size(0) == k_buf.size(0) &&
              k_buf.size(1) == Hkv && v_buf.size(1) == Hkv && k_buf.size(3) == D && v_buf.size(3) == D &&
              k_buf.stride(3) == 1 && v_buf.stride(3) == 1, "kv buffers must be [B, Hkv, S, D] with unit stride on D");
  TORCH_CHECK(rows || (start >= 0 && start + T <= k_buf.size(2) && start + T <= v_buf.size(2)),
              "rows ", start, "..", start + T, " exceed the kv buffer of ", k_buf.size(2));
  auto q = torch::empty({B, Hq, T, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t W = qkv.size(1), heads = Hq + 2 * Hkv;
  const int64_t grain = std::max<int64_t>(1, 4096 / (D * heads));
  // kp, vp: the cache's fp32 or fp16 elements (fp16: each fp32 result rounded to nearest even, as
  // torch's copy into an fp16 tensor rounds it)
  auto run = [&](auto* kp, auto* vp) {
  at::parallel_for(0, B * T, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> rot(D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T;
      const int64_t kv_b = rows ? row_slot[t] : b, at = rows ? row_index[t] : start + t;
      rope_row(src + r * W, cp + r * D, sp + r * D, Hq, Hkv, D, qp + (b * Hq * T + t) * D, T * D,
               kp + kv_b * k_buf.stride(0) + at * k_buf.stride(2), k_buf.stride(1),
               vp + kv_b * v_buf.stride(0) + at * v_buf.stride(2), v_buf.stride(1), rot.data());
    }
  });
  };
  if (k_buf.scalar_type() == torch::kHalf)
    run(k_buf.data_ptr<at::Half>(), v_buf.data_ptr<at::Half>());
  else
    run(k_buf.data_ptr<float>(), v_buf.data_ptr<float>());
  return q;
}

// gu [.., 2I] fp32 contiguous (gate | up, as the fused gate_up linear writes them) -> [.., I]:
// silu(g) * u = (g * sigmoid(g)) * u, sigmoid from e = e^-|g| <= 1 (1 / (1 + e) for g >= 0,
// e / (1 + e) below), so no lane overflows
torch::Tensor silu_mul(torch::Tensor gu) {
  expect(gu, "gate_up", torch::kFloat32);
  TORCH_CHECK(gu.is_contiguous() && gu.dim() >= 1 && gu.size(-1) % 2 == 0,
              "gate_up must be contiguous [.., 2I], got ", gu.sizes());
  const int64_t I = gu.size(-1) / 2, N = gu.numel() / (2 * I);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * 2 * I, I, yp + r * I);
  });
  return y;
}

}  // namespace eagle3
