// Small-M linear layers for CPU inference, AVX-512: y[M, O] = x[M, I] @ W[O, I]^T (+ bias).
//
// Decode and tree verification multiply a few rows by every weight once, so the cost is reading
// the weights. W is packed once into blocks of 32 outputs ("pack_*" in eagle3/kernels/__init__.py),
// each block one contiguous stream; a thread takes whole blocks, and inside a block up to 8 rows of
// x share every weight load. Each output lane accumulates over the input in one fixed order, the
// same for any M and any split of blocks over threads, so a row's result never depends on the
// other rows of the call: a verify block equals one-token decode bit for bit in these layers.
//
//   linear_bf16: packed [O/32, I/2, 32, 2] bf16 (pairs of inputs, AVX512-BF16 dot products);
//                x [M, I] bf16 (I even), fp32 accumulate and out
//   linear_fp32: packed [O/32, I, 32] fp32; x [M, I] fp32; fp32 FMA
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;   // outputs per packed block (two zmm of fp32 accumulators)
constexpr int kMaxTile = 8;      // rows of x per pass over a block

inline void store(float* y, __m512 a0, __m512 a1, const float* bias, int valid) {
  if (bias) {
    a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1), bias));
    a1 = _mm512_add_ps(a1, _mm512_maskz_loadu_ps(valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1), bias + 16));
  }
  if (valid >= 32) {
    _mm512_storeu_ps(y, a0);
    _mm512_storeu_ps(y + 16, a1);
  } else {
    _mm512_mask_storeu_ps(y, valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1), a0);
    if (valid > 16) _mm512_mask_storeu_ps(y + 16, (__mmask16)((1u << (valid - 16)) - 1), a1);
  }
}

template <int MT>
void tile_bf16(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t I2, float* y, int64_t ldy,
               const float* bias, int valid) {
  __m512 a0[MT], a1[MT];
  for (int j = 0; j < MT; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < I2; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * kBlock);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * kBlock + 16);
    for (int j = 0; j < MT; ++j) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[j * ldx + p]);
      a0[j] = _mm512_dpbf16_ps(a0[j], xv, w0);
      a1[j] = _mm512_dpbf16_ps(a1[j], xv, w1);
    }
  }
  for (int j = 0; j < MT; ++j) store(y + j * ldy, a0[j], a1[j], bias, valid);
}

template <int MT>
void tile_fp32(const float* x, int64_t ldx, const float* w, int64_t I, float* y, int64_t ldy,
               const float* bias, int valid) {
  __m512 a0[MT], a1[MT];
  for (int j = 0; j < MT; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; ++i) {
    const __m512 w0 = _mm512_loadu_ps(w + i * kBlock);
    const __m512 w1 = _mm512_loadu_ps(w + i * kBlock + 16);
    for (int j = 0; j < MT; ++j) {
      const __m512 xv = _mm512_set1_ps(x[j * ldx + i]);
      a0[j] = _mm512_fmadd_ps(xv, w0, a0[j]);
      a1[j] = _mm512_fmadd_ps(xv, w1, a1[j]);
    }
  }
  for (int j = 0; j < MT; ++j) store(y + j * ldy, a0[j], a1[j], bias, valid);
}

template <typename T, typename F>
void run(const T* x, int64_t ldx, const T* w, int64_t depth, const float* bias, float* y,
         int64_t M, int64_t O, F tiles) {
  const int64_t blocks = (O + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const T* wb = w + b * depth * kBlock;
      const int valid = (int)std::min<int64_t>(kBlock, O - b * kBlock);
      const float* bb = bias ? bias + b * kBlock : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int mt = (int)std::min<int64_t>(kMaxTile, M - m0);
        tiles[mt - 1](x + m0 * ldx, ldx, wb, depth, y + m0 * O + b * kBlock, O, bb, valid);
      }
    }
  });
}

void check(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
           int64_t out_features, c10::ScalarType dt) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dt, "x must be a contiguous [M, I] tensor of the kernel's dtype");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == dt, "packed weight of the kernel's dtype expected");
  TORCH_CHECK(packed.size(0) * kBlock >= out_features, "out_features ", out_features, " exceeds the packed blocks");
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out_features, "bias must be fp32 [O]");
}

using TileBf16 = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, int64_t, const float*, int);
using TileFp32 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*, int);
const TileBf16 kTilesBf16[kMaxTile] = {tile_bf16<1>, tile_bf16<2>, tile_bf16<3>, tile_bf16<4>,
                                       tile_bf16<5>, tile_bf16<6>, tile_bf16<7>, tile_bf16<8>};
const TileFp32 kTilesFp32[kMaxTile] = {tile_fp32<1>, tile_fp32<2>, tile_fp32<3>, tile_fp32<4>,
                                       tile_fp32<5>, tile_fp32<6>, tile_fp32<7>, tile_fp32<8>};

}  // namespace

// packed [O/32, I/2, 32, 2] bf16; x [M, I] bf16 with I == 2 * packed.size(1)
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features) {
  check(x, packed, bias, out_features, torch::kBFloat16);
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), "x width ", x.size(1), " != packed width ", 2 * packed.size(1));
  const int64_t M = x.size(0);
  auto y = torch::empty({M, out_features}, x.options().dtype(torch::kFloat32));
  run(reinterpret_cast<const uint32_t*>(x.data_ptr()), x.size(1) / 2,
      reinterpret_cast<const uint32_t*>(packed.data_ptr()), packed.size(1),
      bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, out_features, kTilesBf16);
  return y;
}

// packed [O/32, I, 32] fp32; x [M, I] fp32
torch::Tensor linear_fp32(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features) {
  check(x, packed, bias, out_features, torch::kFloat32);
  TORCH_CHECK(x.size(1) == packed.size(1), "x width ", x.size(1), " != packed width ", packed.size(1));
  const int64_t M = x.size(0);
  auto y = torch::empty({M, out_features}, x.options());
  run(x.data_ptr<float>(), x.size(1), packed.data_ptr<float>(), packed.size(1),
      bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, out_features, kTilesFp32);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "small-M linear: packed bf16 weight, bf16 x, fp32 out");
  m.def("linear_fp32", &linear_fp32, "small-M linear: packed fp32 weight and x");
}
