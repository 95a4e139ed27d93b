// Small-M linear layers on packed float weights, AVX-512: y[M, O] = x[M, I] @ W[O, I]^T (+ bias).
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
//
// This file owns both entry points and their vector path (the AVX512-BF16 dot products only in
// target("avx512bf16") functions); linear_bf16(amx=true) hands the same packed weight to the AMX
// tiles (linear_amx.cpp). The packing itself is Python's (pack_weight).
#include "amx.h"
#include "kernels.h"

namespace eagle3 {
namespace {

constexpr int kMaxTile = 8;      // rows of x per pass over a block

// The build has no -mavx512bf16: only functions marked BF16 may hold AVX512-BF16 instructions,
// and only linear_bf16 (after a CPU check) calls them. Check: objdump -d the .so | grep vdpbf16ps
// finds it in tile_bf16<*> only (tests/test_kernel_build.py).
#define BF16 __attribute__((target("avx512bf16")))

// The two weight formats differ only in how a weight vector is loaded, an input broadcast and the
// multiply-accumulate done: bf16 pairs (16 lanes x 2 inputs, dot products) or fp32 (16 x 1, FMA).
struct Bf16Ops {
  using T = uint32_t;              // a pair of bf16 values
  using V = __m512bh;
  BF16 static V load(const T* p) { return (V)_mm512_loadu_si512(p); }
  BF16 static V bcast(T x) { return (V)_mm512_set1_epi32((int)x); }
  BF16 static __m512 fma(__m512 acc, V x, V w) { return _mm512_dpbf16_ps(acc, x, w); }
};

struct Fp32Ops {
  using T = float;
  using V = __m512;
  static V load(const T* p) { return _mm512_loadu_ps(p); }
  static V bcast(T x) { return _mm512_set1_ps(x); }
  static __m512 fma(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

// MT rows of x against one 32-output block; depth = inputs (fp32) or input pairs (bf16)
template <class Ops, int MT>
void tile(const typename Ops::T* x, int64_t ldx, const typename Ops::T* w, int64_t depth, float* y,
          int64_t ldy, const float* bias, int valid, const typename Ops::T* next) {
  __m512 a0[MT], a1[MT];
  for (int j = 0; j < MT; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < depth; ++p) {
    if (next) {   // the next block streams into L2 while this one computes (same offset there)
      _mm_prefetch(reinterpret_cast<const char*>(next + p * kBlock), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + p * kBlock + 16), _MM_HINT_T1);
    }
    const typename Ops::V w0 = Ops::load(w + p * kBlock), w1 = Ops::load(w + p * kBlock + 16);
    for (int j = 0; j < MT; ++j) {
      const typename Ops::V xv = Ops::bcast(x[j * ldx + p]);
      a0[j] = Ops::fma(a0[j], xv, w0);
      a1[j] = Ops::fma(a1[j], xv, w1);
    }
  }
  for (int j = 0; j < MT; ++j) store(y + j * ldy, a0[j], a1[j], bias, valid);
}

// tile<Bf16Ops, MT> compiled for AVX512-BF16: flatten inlines it and Bf16Ops into this function
template <int MT>
BF16 __attribute__((flatten)) void tile_bf16(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t depth,
                                             float* y, int64_t ldy, const float* bias, int valid,
                                             const uint32_t* next) {
  tile<Bf16Ops, MT>(x, ldx, w, depth, y, ldy, bias, valid, next);
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
        const T* next = m0 == 0 && b + 1 < b1 ? wb + depth * kBlock : nullptr;   // first pass only
        tiles[mt - 1](x + m0 * ldx, ldx, wb, depth, y + m0 * O + b * kBlock, O, bb, valid, next);
      }
    }
  });
}

void check(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
           int64_t out_features, c10::ScalarType dt) {
  expect(x, "x", dt);
  expect(packed, "packed weight", dt);
  if (bias) expect(*bias, "bias", torch::kFloat32);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dt, "x must be a contiguous [M, I] tensor of the kernel's dtype");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == dt, "packed weight of the kernel's dtype expected");
  TORCH_CHECK(packed.size(0) * kBlock >= out_features, "out_features ", out_features, " exceeds the packed blocks");
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out_features, "bias must be fp32 [O]");
}

using TileBf16 = void (*)(const uint32_t*, int64_t, const uint32_t*, int64_t, float*, int64_t, const float*, int,
                          const uint32_t*);
using TileFp32 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*, int,
                          const float*);
const TileBf16 kTilesBf16[kMaxTile] = {tile_bf16<1>, tile_bf16<2>, tile_bf16<3>, tile_bf16<4>,
                                       tile_bf16<5>, tile_bf16<6>, tile_bf16<7>, tile_bf16<8>};
const TileFp32 kTilesFp32[kMaxTile] = {tile<Fp32Ops, 1>, tile<Fp32Ops, 2>, tile<Fp32Ops, 3>, tile<Fp32Ops, 4>,
                                       tile<Fp32Ops, 5>, tile<Fp32Ops, 6>, tile<Fp32Ops, 7>, tile<Fp32Ops, 8>};

}  // namespace

// packed [O/32, I/2, 32, 2] bf16; x [M, I] bf16 with I == 2 * packed.size(1)
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features, bool amx) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "linear_bf16 needs a CPU with AVX512-BF16; "
              "use fp32 weights (eagle3.kernels hands this kernel out only where the CPU has it)");
  check(x, packed, bias, out_features, torch::kBFloat16);
  TORCH_CHECK(x.size(1) == 2 * packed.size(1), "x width ", x.size(1), " != packed width ", 2 * packed.size(1));
  const int64_t M = x.size(0);
  auto y = torch::empty({M, out_features}, x.options().dtype(torch::kFloat32));
  if (amx) {
    TORCH_CHECK(packed.size(1) % kAmxPairs == 0, "linear_bf16(amx=True) needs an input width that is a "
                "multiple of 32, got ", x.size(1), "; pass amx=False (the vector path)");
    TORCH_CHECK(amx_permitted(), "linear_bf16(amx=True): this CPU or kernel grants no AMX tiles; pass "
                "amx=False, or EAGLE3_AMX=0 so eagle3.kernels never asks");
    run_amx(reinterpret_cast<const uint32_t*>(x.data_ptr()), x.size(1) / 2,
            reinterpret_cast<const uint32_t*>(packed.data_ptr()), packed.size(1),
            bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, out_features);
    return y;
  }
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

}  // namespace eagle3
