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
//
// Also row-stable fused ops for the same forwards (one pass per row, fixed order, fp32):
//   rms_norm:  y = x / sqrt(mean(x^2) + eps) * w, per row of [N, H]
//   attention: softmax(q k^T / sqrt(D) + mask) v per query row, GQA, over a cache prefix (a run of
//              query rows shares one pass over the keys, each row adding as it does alone)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <vector>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <cpuid.h>
#include <limits>
#include <sys/syscall.h>
#include <unistd.h>

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

// The build has no -mavx512bf16: only functions marked BF16 may hold AVX512-BF16 instructions,
// and only linear_bf16 (after a CPU check) calls them. Check: objdump -d the .so | grep vdpbf16ps
// finds it in tile_bf16<*> only (tests/test_kernels.py).
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

// a CPU tensor of dtype dt, or an error naming the argument and what it got
void expect(const torch::Tensor& t, const char* name, c10::ScalarType dt) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU (eagle3 kernels), got ", t.device());
  TORCH_CHECK(t.scalar_type() == dt, name, " must be ", c10::toString(dt), ", got ", t.scalar_type());
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

// --------------------------------------------------------------------- bf16 on AMX tiles
// linear_bf16(amx=true): the same packed weight on AMX-BF16 tile multiplies, where the CPU has them
// (Sapphire Rapids and later) and the input width is a multiple of 32. Per 32-output block and 16
// input pairs: the rows of x (up to 16) form tile A [rows x 32 bf16], the block's halves form tiles
// B0, B1 [16 pairs x 16 outputs x 2] (the packed rows are 128 bytes: stride 128, each half 64), and
// tdpbf16ps accumulates C0, C1 [rows x 16 fp32]. A row of C depends only on its own row of A, and
// the pairs are taken in one fixed order, so a row's result never depends on the call's other rows
// (row-stable, as the vector path; the two paths round differently, so a packed weight keeps one).
// One tile multiply does 16 x 16 x 32 products: verify blocks of 2..16 rows cost about one row.
// Tile numbers: 0, 1 = C0, C1; 2, 5 = A; 3, 4 and 6, 7 = B0, B1 (amx_block). A thread's tiles stay
// configured after a call (tilerelease would only make the next call's first load pay to wake
// them). AMX instructions only in AMX functions (no -mamx-* for the file; tests/test_amx.py).
// A compiler without AMX intrinsics (GCC < 11, clang < 12) builds everything else: amx_permitted()
// is then false and eagle3.kernels never asks for tiles.
#ifndef EAGLE3_AMX_BUILT
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define EAGLE3_AMX_BUILT 1
#else
#define EAGLE3_AMX_BUILT 0
#endif
#endif
#define AMX __attribute__((target("amx-tile,amx-bf16")))

constexpr int kAmxRows = 16;     // rows of x per tile pass
constexpr int64_t kAmxPairs = 16;   // input pairs per tile multiply (64 bytes of A's row)

#if EAGLE3_AMX_BUILT
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// the thread's tile shapes for `rows` rows of x (every call configures: oneDNN may have changed
// them). The configurations live in a static table: GCC's _tile_loadconfig tells the compiler it
// reads 8 bytes, so a configuration built on the stack just before could be half stored.
AMX void amx_configure(int rows) {
  static const auto table = [] {
    std::array<TileConfig, kAmxRows + 1> t{};
    for (int r = 1; r <= kAmxRows; ++r) {
      for (int i : {0, 1, 2, 5}) { t[r].rows[i] = (uint8_t)r; t[r].colsb[i] = 64; }
      for (int i : {3, 4, 6, 7}) { t[r].rows[i] = (uint8_t)kAmxPairs; t[r].colsb[i] = 64; }
    }
    return t;
  }();
  _tile_loadconfig(&table[rows]);
}

// rows x [rows, ldx pairs] against one block of depth pairs (depth % 16 == 0) -> out [rows, 32].
// Two sets of A/B tiles (2, 3, 4 and 5, 6, 7) alternate, so the next step's loads need not wait
// for this step's multiplies to release their tiles (tiles are not renamed): at one row the loads
// are what costs. No software prefetch: the hardware's streams do better here (a prefetch of the
// next block, as the vector path has, cost ~15% at one row).
AMX void amx_block(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t depth, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  const int64_t stride = kBlock * 4;
  int64_t p = 0;
  for (; p + 2 * kAmxPairs <= depth; p += 2 * kAmxPairs) {
    const uint32_t* w1 = w + (p + kAmxPairs) * kBlock;
    _tile_loadd(2, x + p, ldx * 4);
    _tile_loadd(3, w + p * kBlock, stride);
    _tile_loadd(4, w + p * kBlock + 16, stride);
    _tile_loadd(5, x + p + kAmxPairs, ldx * 4);
    _tile_loadd(6, w1, stride);
    _tile_loadd(7, w1 + 16, stride);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
  }
  if (p < depth) {
    _tile_loadd(2, x + p, ldx * 4);
    _tile_loadd(3, w + p * kBlock, stride);
    _tile_loadd(4, w + p * kBlock + 16, stride);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, out, stride);
  _tile_stored(1, out + 16, stride);
}

#endif  // EAGLE3_AMX_BUILT

// may this process use AMX tiles (asked once: Linux grants the tile state per process)
bool amx_permitted() {
  static const bool ok = [] {
#if defined(__linux__) && EAGLE3_AMX_BUILT
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

void run_amx(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t depth, const float* bias, float* y,
             int64_t M, int64_t O) {
#if !EAGLE3_AMX_BUILT
  TORCH_CHECK(false, "run_amx: this build has no AMX code (linear_bf16 checks amx_permitted first)");
#else
  const int64_t blocks = (O + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float out[kAmxRows * kBlock];
    int configured = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const uint32_t* wb = w + b * depth * kBlock;
      const int valid = (int)std::min<int64_t>(kBlock, O - b * kBlock);
      const float* bb = bias ? bias + b * kBlock : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
        const int mt = (int)std::min<int64_t>(kAmxRows, M - m0);
        if (mt != configured) amx_configure(configured = mt);
        amx_block(x + m0 * ldx, ldx, wb, depth, out);
        for (int j = 0; j < mt; ++j)
          store(y + (m0 + j) * O + b * kBlock, _mm512_load_ps(out + j * kBlock),
                _mm512_load_ps(out + j * kBlock + 16), bb, valid);
      }
    }
  });
#endif
}

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


// ---------------------------------------------------------------------------------- fused ops
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

// lane k = the sum of p[k]'s lanes, added in _mm512_reduce_add_ps's order (lane e with e+8, then
// e+4, then e+2 paired as (0,2) and (1,3), then the two): sixteen reductions for the price of ~3
inline __m512 reduce16(const __m512* p) {
  __m512 s1[8], s2[4], s3[2];
  for (int m = 0; m < 8; ++m)   // (e, e+8): [A.lo | B.lo] + [A.hi | B.hi]
    s1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0xEE),
                          _mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0x44));
  for (int n = 0; n < 4; ++n)   // (e, e+4) inside each half: quarters 1, 3 + quarters 0, 2
    s2[n] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * n], s1[2 * n + 1], 0xDD),
                          _mm512_shuffle_f32x4(s1[2 * n], s1[2 * n + 1], 0x88));
  for (int r = 0; r < 2; ++r)   // (0, 2) and (1, 3) inside each quarter
    s3[r] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * r], s2[2 * r + 1], 0x44),
                          _mm512_shuffle_ps(s2[2 * r], s2[2 * r + 1], 0xEE));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88),   // the last pair
                                 _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
  // lane 4j + c of f holds p[4c + j]
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, f);
}

// lane k = dot(q, k0 + k * ldk, D) for keys k < n (bit for bit), 0 for the rest. Each key's sum
// is its own chain of FMAs over q's chunks in order (the same additions for any n); the chains of
// the 16 keys are interleaved so the FMA latency is hidden and every q chunk is loaded once (keys
// past n re-read key n - 1, so the loop has no branch, and their lanes are zeroed).
inline __m512 dots16(const float* q, const float* k0, int64_t ldk, int64_t n, int64_t D) {
  __m512 p[16];
  const float* kr[16];
  for (int key = 0; key < 16; ++key) {
    p[key] = _mm512_setzero_ps();
    kr[key] = k0 + std::min<int64_t>(key, n - 1) * ldk;
  }
  const int64_t full = D / 16 * 16;
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int key = 0; key < 16; ++key) p[key] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[key] + i), p[key]);
  }
  if (full < D) {
    const __mmask16 tm = (__mmask16)((1u << (D - full)) - 1);
    const __m512 qv = _mm512_maskz_loadu_ps(tm, q + full);
    for (int key = 0; key < 16; ++key)
      p[key] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tm, kr[key] + full), p[key]);
  }
  return _mm512_maskz_mov_ps(n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1), reduce16(p));
}

// software prefetch into L2 of rows [0, n) of a [*, ld] fp32 matrix, D floats each (n <= 0: nothing)
inline void prefetch_rows(const float* p, int64_t ld, int64_t n, int64_t D) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; d += 16) _mm_prefetch(reinterpret_cast<const char*>(p + r * ld + d), _MM_HINT_T1);
}

// e^x for x <= 0 (Cephes expf polynomial, 2^n by scalef); lanes are independent
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// the data of an int64 [n] per-row index, every value checked to lie in [lo, hi]
const int64_t* checked_rows(const torch::Tensor& t, const char* name, int64_t n, int64_t lo, int64_t hi) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.size(0) == n &&
              t.is_contiguous(), name, " must be a contiguous int64 CPU tensor [", n, "], got ", t.sizes());
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(p[i] >= lo && p[i] <= hi, name, "[", i, "] = ", p[i], " outside [", lo, ", ", hi, "]");
  return p;
}

}  // namespace

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
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      const float scale = 1.0f / std::sqrt(dot(xr, xr, H) / (float)H + (float)eps);
      for (int64_t i = 0; i < H; ++i) yp[r * H + i] = xr[i] * scale * wp[i];
    }
  });
  return y;
}

namespace {

// out_i[0..16*ND) = inv_i * sum_j p_i[j * ps] * v[j] for G rows sharing v, j in order for each
// row (the same additions as one row alone: rows only share the loads of v)
template <int ND, int G>
inline void weighted_sums(const float* const* p, int64_t ps, const float* v, int64_t ldv, int64_t S,
                          const float* inv, float* const* out) {
  __m512 a[G][ND];
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) a[i][d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; ++j) {
    __m512 vj[ND];
    for (int d = 0; d < ND; ++d) vj[d] = _mm512_loadu_ps(v + j * ldv + 16 * d);
    for (int i = 0; i < G; ++i) {
      const __m512 pj = _mm512_set1_ps(p[i][j * ps]);
      for (int d = 0; d < ND; ++d) a[i][d] = _mm512_fmadd_ps(pj, vj[d], a[i][d]);
    }
  }
  for (int i = 0; i < G; ++i) {
    const __m512 iv = _mm512_set1_ps(inv[i]);
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(out[i] + 16 * d, _mm512_mul_ps(a[i][d], iv));
  }
}

template <int ND>
void weighted_sums_rows(const float* const* p, int64_t ps, const float* v, int64_t ldv, int64_t S,
                        const float* inv, float* const* out, int64_t rows) {
  // up to G rows at a time (G * ND accumulators stay in the 32 zmm registers; more rows, more
  // independent FMA chains): a GQA group of 3 query heads is one pass of 3, not three of 1
  constexpr int G = ND <= 4 ? 4 : 2;
  int64_t i = 0;
  for (; i + G <= rows; i += G) weighted_sums<ND, G>(p + i, ps, v, ldv, S, inv + i, out + i);
  if constexpr (G > 3) {
    if (rows - i == 3) {
      weighted_sums<ND, 3>(p + i, ps, v, ldv, S, inv + i, out + i);
      i += 3;
    }
  }
  if constexpr (G > 2) {
    if (rows - i >= 2) {
      weighted_sums<ND, 2>(p + i, ps, v, ldv, S, inv + i, out + i);
      i += 2;
    }
  }
  for (; i < rows; ++i) weighted_sums<ND, 1>(p + i, ps, v, ldv, S, inv + i, out + i);
}

// ---- several query rows of one kv head in one pass: a zmm lane per (row, head of the group)

// 1 + the last key a mask row lets through (0: none), so keys after it (a causal block's
// future) are not visited: they would add exact zeros
inline int64_t last_live(const bool* m, int64_t S) {
  int64_t e = S;
  while (e >= 64 && _mm512_test_epi8_mask(_mm512_loadu_si512(m + e - 64), _mm512_set1_epi8(1)) == 0) e -= 64;
  while (e > 0 && !m[e - 1]) --e;
  return e;
}

// reduce16's tree, leaf by leaf: ((0+8)+(4+12)) + ((2+10)+(6+14)) for the even lanes, the odd
// lanes likewise, then the two halves
constexpr int kLeaves[2][8] = {{0, 8, 4, 12, 2, 10, 6, 14}, {1, 9, 5, 13, 3, 11, 7, 15}};

inline __m512 tree8(const __m512* a) {
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                       _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])));
}

// lane i of s0 (s1) = dot(q_i, key k0 (k1)) for the queries of qt (qt[16 d + i] = q_i[d], D = 16
// NC), each made of dots16's additions: per lane of a 16-wide chunk, the chunks' products chained
// in order, then those 16 partial sums added in reduce16's tree. So a lane equals dots16's lane
// for the same query and key, bit for bit, and the keys' loads are shared by every query.
template <int NC>
inline void lane_dots2(const float* qt, const float* k0, const float* k1, __m512& s0, __m512& s1) {
  __m512 w0[2], w1[2];
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m512 a[8], b[8];
    for (int i = 0; i < 8; ++i) a[i] = b[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c)
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {      // unrolled: the offsets are constants
        const int d = 16 * c + kLeaves[h][i];
        const __m512 qv = _mm512_loadu_ps(qt + 16 * d);
        a[i] = _mm512_fmadd_ps(qv, _mm512_set1_ps(k0[d]), a[i]);
        b[i] = _mm512_fmadd_ps(qv, _mm512_set1_ps(k1[d]), b[i]);
      }
    w0[h] = tree8(a);
    w1[h] = tree8(b);
  }
  s0 = _mm512_add_ps(w0[0], w0[1]);
  s1 = _mm512_add_ps(w1[0], w1[1]);
}

// The `lanes` = rows x group queries of one kv head (lane r * group + i: row r, head i), over keys
// [0, S): row r sees key s where s < keys[r] and (mask[r] null or mask[r][s]). Every lane does the
// one-row path's arithmetic (its dot products, max, exponentials, a sum over the keys in order,
// weighted sums in order; keys a row does not see add exact zeros), so a row's bits do not depend
// on the rows it shares the pass with. qt: 16 D floats, sc: 16 S floats of scratch.
template <int ND>
void attention_lanes(const float* const* q, float* const* out, int64_t rows, int64_t group,
                     const float* kb, int64_t ldk, const float* vb, int64_t ldv, int64_t S,
                     const bool* const* mask, const int64_t* keys, float scale, float* qt, float* sc) {
  constexpr int64_t D = 16 * ND;
  const int64_t lanes = rows * group;
  std::fill(qt, qt + 16 * D, 0.0f);
  for (int64_t i = 0; i < lanes; ++i)
    for (int64_t d = 0; d < D; ++d) qt[16 * d + i] = q[i][d];
  const __mmask16 row_bits = (__mmask16)((1u << group) - 1);
  const __mmask16 all = (__mmask16)((1u << lanes) - 1);
  int64_t open = S;                  // keys [0, open) are seen by every row (the context)
  for (int64_t r = 0; r < rows; ++r) {
    open = std::min(open, keys[r]);
    if (mask[r]) open = std::find(mask[r], mask[r] + open, false) - mask[r];
  }
  auto live = [&](int64_t s) {
    if (s < open) return all;
    __mmask16 m = 0;
    for (int64_t r = 0; r < rows; ++r)
      if (s < keys[r] && (!mask[r] || mask[r][s])) m |= (__mmask16)(row_bits << (r * group));
    return m;
  };
  const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
  __m512 mx = ninf;
  for (int64_t s = 0; s < S; s += 2) {
    const float* k0 = kb + s * ldk;
    const bool pair = s + 1 < S;
    __m512 d0, d1;
    lane_dots2<ND>(qt, k0, pair ? k0 + ldk : k0, d0, d1);
    const __m512 x0 = _mm512_mask_mov_ps(ninf, live(s), _mm512_mul_ps(d0, vscale));
    _mm512_storeu_ps(sc + 16 * s, x0);
    mx = _mm512_max_ps(mx, x0);
    if (pair) {
      const __m512 x1 = _mm512_mask_mov_ps(ninf, live(s + 1), _mm512_mul_ps(d1, vscale));
      _mm512_storeu_ps(sc + 16 * (s + 1), x1);
      mx = _mm512_max_ps(mx, x1);
    }
  }
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const __m512 x = _mm512_loadu_ps(sc + 16 * s);
    const __mmask16 on = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    const __m512 p = _mm512_maskz_mov_ps(on, exp_neg(_mm512_sub_ps(x, mx)));
    _mm512_storeu_ps(sc + 16 * s, p);
    sum = _mm512_add_ps(sum, p);
  }
  alignas(64) float sums[16], inv[16];
  _mm512_store_ps(sums, sum);
  const float* p[16];
  for (int64_t i = 0; i < lanes; ++i) {
    inv[i] = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
    p[i] = sc + i;
  }
  weighted_sums_rows<ND>(p, 16, vb, ldv, S, inv, out, lanes);
}

}  // namespace

// q [B, Hq, T, D] fp32 contiguous; k, v [B, Hkv, S, D] fp32 views with unit stride on D (a cache
// prefix); mask: None, or bool broadcastable as [B|1, 1, T, S] contiguous (True = may attend).
// One work item is the `group` query heads of one kv head at one query position: they share
// every k and v row, and their independent dot products and sums keep the core busy. Each row's
// arithmetic is the same whatever else is in the item.
// Rows of several sequences (continuous batching): q [1, Hq, N, D] holds N rows, k/v [slots, Hkv,
// S, D] a cache slot per sequence; row t attends to keys [0, keys_of_row[t]) of slot
// slot_of_row[t] (int64 [N] each; mask None). Same arithmetic as a masked block: masked keys only
// add exact zeros there, so a row gets the bits of its sequence run alone.
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                        c10::optional<torch::Tensor> slot_of_row = c10::nullopt,
                        c10::optional<torch::Tensor> keys_of_row = c10::nullopt) {
  expect(q, "q", torch::kFloat32);
  expect(k, "k", torch::kFloat32);
  expect(v, "v", torch::kFloat32);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [B, heads, rows, D]");
  TORCH_CHECK(q.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1, "q contiguous, k/v unit stride on D");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S_all = k.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads ", Hq, " not a multiple of kv heads ", Hkv);
  const int64_t group = Hq / Hkv;
  const bool rows = slot_of_row.has_value();
  TORCH_CHECK(rows == keys_of_row.has_value(), "slot_of_row and keys_of_row go together");
  const int64_t* row_slot = rows ? checked_rows(*slot_of_row, "slot_of_row", T, 0, k.size(0) - 1) : nullptr;
  const int64_t* row_keys = rows ? checked_rows(*keys_of_row, "keys_of_row", T, 1, k.size(2)) : nullptr;
  TORCH_CHECK(!rows || (B == 1 && !mask), "rows of several sequences: q must be [1, Hq, N, D], mask None");
  TORCH_CHECK(rows || (k.size(0) == B && v.size(0) == B), "batch: q ", B, ", k ", k.size(0), ", v ", v.size(0));
  TORCH_CHECK(v.size(0) == k.size(0), "batch: k ", k.size(0), ", v ", v.size(0));
  TORCH_CHECK(v.size(1) == Hkv && v.size(2) == S_all, "v [", v.size(1), ", ", v.size(2), "] != k heads/keys [", Hkv, ", ", S_all, "]");
  TORCH_CHECK(k.size(3) == D && v.size(3) == D, "head_dim: q ", D, ", k ", k.size(3), ", v ", v.size(3));
  const bool* mp = nullptr;
  int64_t mask_b = 0;
  if (mask) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() && mask->dim() == 4 &&
                mask->size(1) == 1 && mask->size(2) == T && mask->size(3) == S_all &&
                (mask->size(0) == 1 || mask->size(0) == B), "mask must be bool [B|1, 1, T, S]");
    mp = mask->data_ptr<bool>();
    mask_b = mask->size(0) == 1 ? 0 : T * S_all;
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt((float)D);
  const int64_t ld = S_all + 16;              // one score row per head of the item
  // Work items: one kv head's `group` query heads at a run of query rows of one sequence. A run of
  // rows shares one pass over the keys (attention_lanes: up to 16 / group rows, a lane per row and
  // head) where D is 64 or 128; else, and for a lone row, a row is an item of its own. A pass costs
  // about what two rows alone cost whatever its lanes, so runs of 1-2 rows go row by row, longer
  // ones in as few passes as the lanes allow, at least one item per thread (SmolLM2's 3-4 rows at
  // 1100 keys: 97 / 113 us a layer in 2-row passes, 84 / 87 us in one pass).
  struct Item { int64_t b, g, t0, n; };
  const int64_t lane_rows = (D == 64 || D == 128) && group <= 8 ? 16 / group : 1;
  const int64_t min_blocks = (at::get_num_threads() + B * Hkv - 1) / (B * Hkv);  // a thread each
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t t = 0; t < T;) {
        int64_t run = 1;                     // rows of one slot (all rows without slots)
        while (t + run < T && (!rows || row_slot[t + run] == row_slot[t])) ++run;
        const int64_t nb = lane_rows == 1 || run < 3 ? run
            : std::min(run, std::max((run + lane_rows - 1) / lane_rows, min_blocks));
        for (int64_t i = 0; i < nb; ++i)     // blocks as even as possible
          items.push_back({b, g, t + run * i / nb, run * (i + 1) / nb - run * i / nb});
        t += run;
      }
  at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> sc(group * ld), mx(group), sum(group), inv(group), acc(D);
    std::vector<const float*> qrow(group), prow(group);
    std::vector<float*> orow(group);
    std::vector<float> qt, sc16;
    for (int64_t r = r0; r < r1; ++r) {
      const Item& it = items[r];
      const int64_t b = it.b, g = it.g, t = it.t0;
      const int64_t kv_b = rows ? row_slot[t] : b;
      const float* kb = kp + kv_b * k.stride(0) + g * k.stride(1);
      const float* vb = vp + kv_b * v.stride(0) + g * v.stride(1);
      if (it.n > 1) {
        const int64_t n = it.n, lanes = n * group;
        std::vector<const float*> lq(lanes);
        std::vector<float*> lo(lanes);
        std::vector<const bool*> lm(n);
        std::vector<int64_t> lk(n);
        int64_t S = 0;
        for (int64_t j = 0; j < n; ++j) {
          lm[j] = mp ? mp + b * mask_b + (t + j) * S_all : nullptr;
          lk[j] = rows ? row_keys[t + j] : lm[j] ? last_live(lm[j], S_all) : S_all;
          S = std::max(S, lk[j]);
          for (int64_t i = 0; i < group; ++i) {
            const int64_t row = (b * Hq + g * group + i) * T + t + j;
            lq[j * group + i] = qp + row * D;
            lo[j * group + i] = op + row * D;
          }
        }
        qt.resize(16 * D);
        sc16.resize(16 * (S + 1));
        if (D == 64)
          attention_lanes<4>(lq.data(), lo.data(), n, group, kb, k.stride(2), vb, v.stride(2), S,
                             lm.data(), lk.data(), scale, qt.data(), sc16.data());
        else
          attention_lanes<8>(lq.data(), lo.data(), n, group, kb, k.stride(2), vb, v.stride(2), S,
                             lm.data(), lk.data(), scale, qt.data(), sc16.data());
        continue;
      }
      const int64_t S = rows ? row_keys[t] : S_all;
      const bool* mr = mp ? mp + b * mask_b + t * S_all : nullptr;
      // the cache rows come from memory (a batch's slots far exceed the caches): the next item's
      // keys and values stream in while this one computes its scores, a share per block of keys
      const float *nk = nullptr, *nv = nullptr;
      int64_t nS = 0;
      if (r + 1 < r1) {
        const Item& nx = items[r + 1];
        const int64_t nkv = rows ? row_slot[nx.t0] : nx.b;
        nS = rows ? row_keys[nx.t0] : S_all;
        nk = kp + nkv * k.stride(0) + nx.g * k.stride(1);
        nv = vp + nkv * v.stride(0) + nx.g * v.stride(1);
      }
      for (int64_t i = 0; i < group; ++i) {
        const int64_t row = (b * Hq + g * group + i) * T + t;
        qrow[i] = qp + row * D;
        orow[i] = op + row * D;
        prow[i] = sc.data() + i * ld;
        mx[i] = -INFINITY;
      }
      for (int64_t s0 = 0; s0 < S; s0 += 16) {
        const int64_t n = std::min<int64_t>(16, S - s0);
        if (nk) {
          const int64_t lo = s0 * nS / S, hi = std::min<int64_t>(S, s0 + 16) * nS / S;
          prefetch_rows(nk + lo * k.stride(2), k.stride(2), hi - lo, D);
          prefetch_rows(nv + lo * v.stride(2), v.stride(2), hi - lo, D);
        }
        __mmask16 live = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        if (mr)
          for (int64_t j = 0; j < n; ++j)
            if (!mr[s0 + j]) live &= (__mmask16)~(1u << j);
        for (int64_t i = 0; i < group; ++i) {
          const __m512 x = _mm512_mul_ps(dots16(qrow[i], kb + s0 * k.stride(2), k.stride(2), n, D),
                                         _mm512_set1_ps(scale));
          const __m512 xs = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, x);
          _mm512_storeu_ps(sc.data() + i * ld + s0, xs);
          mx[i] = std::max(mx[i], _mm512_reduce_max_ps(xs));
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        float* si = sc.data() + i * ld;
        for (int64_t s = 0; s < S; s += 16) {
          const __mmask16 m = S - s >= 16 ? 0xFFFF : (__mmask16)((1u << (S - s)) - 1);
          const __m512 x = _mm512_maskz_loadu_ps(m, si + s);
          const __mmask16 live = _mm512_mask_cmp_ps_mask(m, x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
          _mm512_mask_storeu_ps(si + s, m,
                                _mm512_maskz_mov_ps(live, exp_neg(_mm512_sub_ps(x, _mm512_set1_ps(mx[i])))));
        }
        sum[i] = 0.0f;
      }
      // sums run over the keys in order, one at a time: masked keys add exact zeros, so a tree
      // node whose ancestors sit between masked siblings gets the bits of its path decoded alone
      // (in registers, up to three rows' chains interleaved)
      for (int64_t i = 0; i < group;) {
        const float* r0p = sc.data() + i * ld;
        if (group - i >= 3) {
          const float *r1p = r0p + ld, *r2p = r1p + ld;
          float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f;
          for (int64_t s = 0; s < S; ++s) a0 += r0p[s], a1 += r1p[s], a2 += r2p[s];
          sum[i] = a0, sum[i + 1] = a1, sum[i + 2] = a2;
          i += 3;
        } else {
          float a0 = 0.0f;
          for (int64_t s = 0; s < S; ++s) a0 += r0p[s];
          sum[i++] = a0;
        }
      }
      // a row that may attend to nothing (padding) gets zeros, as SDPA gives, not 0 * inf = NaN
      for (int64_t i = 0; i < group; ++i) inv[i] = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
      if (D == 64) {
        weighted_sums_rows<4>(prow.data(), 1, vb, v.stride(2), S, inv.data(), orow.data(), group);
      } else if (D == 128) {
        weighted_sums_rows<8>(prow.data(), 1, vb, v.stride(2), S, inv.data(), orow.data(), group);
      } else {
        for (int64_t i = 0; i < group; ++i) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t j = 0; j < S; ++j) {
            const float* vr = vb + j * v.stride(2);
            for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(prow[i][j], vr[d], acc[d]);
          }
          for (int64_t d = 0; d < D; ++d) orow[i][d] = acc[d] * inv[i];
        }
      }
    }
  });
  return out;
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
                       c10::optional<torch::Tensor> slot_of_row = c10::nullopt,
                       c10::optional<torch::Tensor> index_of_row = c10::nullopt) {
  expect(qkv, "qkv", torch::kFloat32);
  expect(cos, "cos", torch::kFloat32);
  expect(sin, "sin", torch::kFloat32);
  expect(k_buf, "k_buf", torch::kFloat32);
  expect(v_buf, "v_buf", torch::kFloat32);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "qkv [B*T, W], cos/sin [B, 1, T, D] contiguous");
  TORCH_CHECK(cos.dim() == 4 && cos.size(1) == 1 && cos.sizes() == sin.sizes(), "cos/sin must be [B, 1, T, D]");
  const int64_t B = cos.size(0), T = cos.size(2), D = cos.size(3), half = D / 2;
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
  float* kp = k_buf.data_ptr<float>();
  float* vp = v_buf.data_ptr<float>();
  const int64_t W = qkv.size(1), heads = Hq + 2 * Hkv;
  const int64_t grain = std::max<int64_t>(1, 4096 / (D * heads));
  at::parallel_for(0, B * T, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T;
      const int64_t kv_b = rows ? row_slot[t] : b, at = rows ? row_index[t] : start + t;
      const float* c = cp + r * D;
      const float* sn = sp + r * D;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = src + r * W + h * D;
        float* dst;
        if (h < Hq) {
          dst = qp + ((b * Hq + h) * T + t) * D;
        } else if (h < Hq + Hkv) {
          dst = kp + kv_b * k_buf.stride(0) + (h - Hq) * k_buf.stride(1) + at * k_buf.stride(2);
        } else {
          dst = vp + kv_b * v_buf.stride(0) + (h - Hq - Hkv) * v_buf.stride(1) + at * v_buf.stride(2);
          for (int64_t d = 0; d < D; ++d) dst[d] = x[d];
          continue;
        }
        for (int64_t d = 0; d < half; ++d) {
          const float a = x[d] * c[d], e = -x[d + half] * sn[d];
          dst[d] = a + e;
        }
        for (int64_t d = half; d < D; ++d) {
          const float a = x[d] * c[d], e = x[d - half] * sn[d];
          dst[d] = a + e;
        }
      }
    }
  });
  return q;
}

// ------------------------------------------------------------------ quantized weights (GGUF)
// y[M, O] = x[M, I] @ W^T with W in the GGUF file's own integer codes, dequantized in registers.
// The packed weight (eagle3/runtime/quant.py pack_quant) is one uint8 tensor: an int64 header
// [magic, segments, I, O, flags] + per segment [kind, out, block, scale_bytes, rec_bytes, offset],
// then each segment's records. flags bit 0: kind-4 segments run on integer dot products (below).
// A segment is a run of outputs in one format (fused q/k/v may mix them); a record covers 16
// outputs (the lanes) x one block of inputs:
//   kind 4 (Q4_0, Q4_1, Q4_K): 32 inputs, 4-bit codes c, w = scale * c + offset.
//       4 x 64 bytes: zmm k, lane o = 8 codes of output o (inputs 8k..8k+7, input 8k+j in bits
//       4j..4j+3); then 16 scales and 16 offsets (fp16 where the file's are exact in fp16, else fp32)
//   kind 5 (Q5_0): 32 inputs, 5-bit codes c, w = scale * (c - 16): the nibbles as kind 4, then
//       64 bytes (zmm lane o: bit j = input j's fifth bit), then 16 scales
//   kind 8 (Q8_0 block 32; Q6_K block 16): int8 codes c, w = scale * c.
//       block x 16 int8 (input-major, lane o = output o); then 16 scales
// Per block and row: dot = sum_j x_j c_j (fp32 FMA, kChains interleaved partial sums), then
// acc = scale * dot (+ offset * sum_j x_j) (the block's input sum, computed once per row): the
// exact model of the file up to fp32 rounding, and each row in one fixed order whatever the call's
// other rows (row-stable, as the bf16 kernels).
//
// Kind 4 on integer dot products (flags bit 0, AVX512-VNNI): the FMA path above spends ~3 vector
// ops a weight turning nibbles into floats and is compute-bound at M = 1 (~20 GB/s of codes, below
// the memory's ~30). Here each row's block of 32 inputs becomes integers X = round(x / s), with
// s = max |x| / kDigitMax per row and block (23 bits under the block's largest input: fp32 carries
// 24 under each value), split into three signed byte digits X = d0 + 256 d1 + 65536 d2 (d0, d1 in
// [-128, 127], d2 in [-128, 127] since |X| <= kDigitMax). Per digit plane the block's dot with the
// 0..15 codes is exact in int32 (vpdpbusd: u8 codes x s8 digits, 64 products an instruction);
// d0 + 256 d1's dot (|.| < 2^24) and d2's are exact in fp32 and joined with one rounding:
// acc += (scale * s) * dot + offset * (s * sum_j X_j). The offset meets the same rounded inputs as
// the codes, so the result is the file's exact weights times inputs moved by at most s / 2. Integer
// sums have no order, so a row's result is independent of the call's other rows.
//
// One digit (flags bit 1, with bit 0; `--weights gguf` on a CPU with VNNI, and q4 drafts): X =
// round(x / s) with s = max |x| / 127 is one signed byte, as llama.cpp rounds activations for its
// integer dots, for every code kind (byte_tile below: its own record layout), so a block costs a
// third of the integer dot products and the inputs move by up to s / 2 (~0.4% of the block's
// largest). `--weights gguf-exact` keeps the exact path.
namespace {

constexpr int64_t kQuantMagic = 0x5451474746;   // "FGGQT": the header with flags
constexpr int64_t kHeaderWords = 5;
constexpr int kPlanes = 3;                       // byte digits per activation
constexpr int kDigitWords = kPlanes * 8;         // int32 words of digits per row and block of 32
constexpr float kDigitMax = 8355000.0f;          // < 127 * (65536 + 256 + 1): d2 never leaves int8
constexpr float kOneDigitMax = 127.0f;           // one digit: X itself is the byte
constexpr int kQuantLanes = 16;

// Each tile asks for the bytes kAhead past the record it reads, a record's worth per record: a
// thread's groups are consecutive in the packed weight, so this runs ahead of its stream, across
// groups and 4 KiB pages, where the hardware's prefetchers stop at each page. At one row the codes
// are read once and the loads wait on memory: SmolLM2's Q4_1 decode forward went from 5.7 to 4.5
// ms (2 threads; 2048 bytes ahead: 4.7, 8192: 4.6).
constexpr int64_t kAhead = 4096;
inline void fetch_ahead(const uint8_t* rec, int64_t rec_bytes) {
  for (int64_t l = 0; l < rec_bytes; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec + kAhead + l), _MM_HINT_T0);
}

struct QuantSeg {
  int64_t kind, out, block, scale_bytes, rec_bytes, offset, out0, group0;
};

struct QuantHeader {
  std::vector<QuantSeg> segs;
  bool integer_dots;           // flags bit 0
  bool one_digit;              // flags bit 1 (with bit 0): inputs rounded to one byte per block
};

QuantHeader quant_header(const torch::Tensor& packed, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.numel() >= 8 * kHeaderWords,
              "packed quantized weight must be a contiguous uint8 tensor from pack_quant");
  const int64_t* h = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>());
  TORCH_CHECK(h[0] == kQuantMagic, "packed quantized weight: bad magic (not made by pack_quant)");
  TORCH_CHECK(h[2] == in_features, "x width ", in_features, " != the packed weight's input width ", h[2]);
  TORCH_CHECK(h[3] == out_features, "out_features ", out_features, " != the packed weight's ", h[3]);
  TORCH_CHECK(h[4] == 0 || h[4] == 1 || h[4] == 3, "packed quantized weight: flags ", h[4], " (known: bit 0, "
              "integer dot products; bit 1 with bit 0, one digit); pack it again with this eagle3's pack_quant");
  std::vector<QuantSeg> segs;
  int64_t out0 = 0, group0 = 0;
  for (int64_t s = 0; s < h[1]; ++s) {
    const int64_t* e = h + kHeaderWords + 6 * s;
    QuantSeg g{e[0], e[1], e[2], e[3], e[4], e[5], out0, group0};
    TORCH_CHECK(((g.kind == 4 || g.kind == 5) && g.block == 32) || (g.kind == 8 && (g.block == 32 || g.block == 16)),
                "packed quantized weight: kind ", g.kind, " with block ", g.block, " has no kernel");
    TORCH_CHECK(g.scale_bytes == 2 || g.scale_bytes == 4, "scale bytes ", g.scale_bytes);
    TORCH_CHECK(in_features % g.block == 0, "input width ", in_features, " not a multiple of block ", g.block);
    const int64_t groups = (g.out + kQuantLanes - 1) / kQuantLanes;
    const int64_t records = (h[4] & 2) ? in_features / 32 : in_features / g.block;   // one digit: 32 inputs
    TORCH_CHECK(!(h[4] & 2) || in_features % 32 == 0, "one digit: input width ", in_features,
                " not a multiple of 32");
    TORCH_CHECK(g.offset + groups * records * g.rec_bytes <= packed.numel(),
                "packed quantized weight is truncated");
    segs.push_back(g);
    out0 += g.out;
    group0 += groups;
  }
  TORCH_CHECK(out0 == out_features, "segments cover ", out0, " outputs, expected ", out_features);
  return {segs, (h[4] & 1) != 0, (h[4] & 2) != 0};
}

inline __m512 load_scales(const uint8_t* p, int64_t scale_bytes) {
  return scale_bytes == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                          : _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

inline void store_lanes(float* y, __m512 a, int valid) {
  if (valid >= 16) _mm512_storeu_ps(y, a);
  else _mm512_mask_storeu_ps(y, (__mmask16)((1u << valid) - 1), a);
}

// Each row's block dot product runs as kChains interleaved partial sums (input j into chain
// j % kChains, added (0+1)+(2+3) at the block's end): one chain would wait on the FMA latency every
// step at M = 1. The same for every tile size, so a row's bits never depend on M.
constexpr int kChains = 4;
constexpr int kQuantTile = 4;    // rows per pass over a group (kChains * rows + rows accumulators)

template <int MT>
inline void finish_block(__m512 (&dot)[MT][kChains], __m512 (&acc)[MT], __m512 s) {
  for (int r = 0; r < MT; ++r) {
    const __m512 d = _mm512_add_ps(_mm512_add_ps(dot[r][0], dot[r][1]), _mm512_add_ps(dot[r][2], dot[r][3]));
    acc[r] = _mm512_fmadd_ps(s, d, acc[r]);
  }
}

// The float codes of a 4- or 5-bit record, input 8k+j of each lane (j a constant after unrolling).
// kind 4: the nibble, 0..15, through a 16-entry table. kind 5 (Q5_0): the nibble plus one high bit
// (bit j of lane o's word in the record's fifth zmm), code - 16, through a 32-entry table.
struct Nibbles {
  static constexpr int64_t kScalesAt = 256;
  static constexpr bool kOffsets = true;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  void block(const uint8_t*) {}
  __m512 code(__m512i n, int, int j) const { return _mm512_permutexvar_ps(_mm512_srli_epi32(n, 4 * j), table); }
};

struct FiveBits {
  static constexpr int64_t kScalesAt = 320;
  static constexpr bool kOffsets = false;
  const __m512 low = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512 high = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  __m512i h = _mm512_setzero_si512();
  void block(const uint8_t* rec) { h = _mm512_loadu_si512(rec + 256); }
  // index bits 0-3: the nibble; bit 4: input 8k+j's high bit shifted to bit 4; 0xCA: mask ? a : b
  __m512 code(__m512i n, int k, int j) const {
    const int bit = 8 * k + j;
    const __m512i hb = bit <= 4 ? _mm512_sll_epi32(h, _mm_cvtsi32_si128(4 - bit))
                                : _mm512_srl_epi32(h, _mm_cvtsi32_si128(bit - 4));
    const __m512i idx = _mm512_ternarylogic_epi32(nibble, _mm512_srli_epi32(n, 4 * j), hb, 0xCA);
    return _mm512_permutex2var_ps(low, idx, high);
  }
};

// MT rows against one group of 16 outputs of a kind-4 or kind-5 segment (Codes: Nibbles / FiveBits)
template <int MT, class Codes>
void nibble_tile(const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* rec,
                 int64_t blocks, int64_t rec_bytes, int64_t sb, float* y, int64_t ldy, int valid) {
  Codes codes;
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, rec += rec_bytes) {
    __m512 dot[MT][kChains];
    for (int r = 0; r < MT; ++r)
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_ps();
    const float* xb = x + b * 32;
    fetch_ahead(rec, rec_bytes);
    codes.block(rec);
    for (int k = 0; k < 4; ++k) {
      const __m512i n = _mm512_loadu_si512(rec + 64 * k);
#define EAGLE3_NIBBLE_STEP(j)                                                                      \
      {                                                                                            \
        const __m512 c = codes.code(n, k, (j));                                                    \
        for (int r = 0; r < MT; ++r)                                                               \
          dot[r][(j) % kChains] =                                                                  \
              _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + 8 * k + (j)]), c, dot[r][(j) % kChains]); \
      }
      EAGLE3_NIBBLE_STEP(0) EAGLE3_NIBBLE_STEP(1) EAGLE3_NIBBLE_STEP(2) EAGLE3_NIBBLE_STEP(3)
      EAGLE3_NIBBLE_STEP(4) EAGLE3_NIBBLE_STEP(5) EAGLE3_NIBBLE_STEP(6) EAGLE3_NIBBLE_STEP(7)
#undef EAGLE3_NIBBLE_STEP
    }
    finish_block<MT>(dot, acc, load_scales(rec + Codes::kScalesAt, sb));
    if (Codes::kOffsets) {
      const __m512 m = load_scales(rec + Codes::kScalesAt + 16 * sb, sb);
      for (int r = 0; r < MT; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * ldxs + b]), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) store_lanes(y + r * ldy, acc[r], valid);
}

// Each row's blocks of 32 inputs as byte digits (the layout nibble_tile_vnni reads): per row and
// block kDigitWords int32, [plane][k][half] with half 0 = inputs 8k + 0, 2, 4, 6 and half 1 =
// 8k + 1, 3, 5, 7 (the byte order of the nibbles masked out of a code word); the block's s and
// s * sum_j X_j. A block with an inf or NaN input gets a NaN s, so its outputs are NaN as on the
// FMA path.
void activation_digits(const float* x, int64_t M, int64_t I, int32_t* digits, float* scale, float* xsum,
                       int32_t* isum, bool one_digit) {
  const int planes = one_digit ? 1 : kPlanes;
  const float digit_max = one_digit ? kOneDigitMax : kDigitMax;
  const int64_t nb = I / 32;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i bias = _mm512_set1_epi32(128), mask = _mm512_set1_epi32(255);
  // bytes of inputs 0..15 in order -> [k][half][pos]: 0 2 4 6, 1 3 5 7, 8 10 12 14, 9 11 13 15
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * I + b * 32;
      const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
      const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v[0]), _mm512_andnot_ps(sign, v[1])));
      int32_t* d = digits + (r * nb + b) * kDigitWords;
      float& s = scale[r * nb + b];
      float& sum = xsum[r * nb + b];
      const bool finite = std::isfinite(m) && !_mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) &&
                          !_mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
      s = finite ? m / digit_max : std::numeric_limits<float>::quiet_NaN();
      if (!finite || !(s > 0.0f)) {            // inf / NaN among the inputs, or all zero (or underflow)
        if (finite) s = 0.0f;
        sum = s;
        std::fill(d, d + kDigitWords, 0);
        isum[2 * (r * nb + b)] = isum[2 * (r * nb + b) + 1] = 0;
        continue;
      }
      const __m512 inv = _mm512_set1_ps(digit_max / m);
      int32_t total = 0;
      for (int h = 0; h < 2; ++h) {           // inputs 16h .. 16h + 15: k = 2h, 2h + 1
        __m512i X = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[h], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const int32_t half_sum = _mm512_reduce_add_epi32(X);
        isum[2 * (r * nb + b) + h] = half_sum;
        total += half_sum;
        for (int p = 0; p < planes; ++p) {
          const __m512i digit = p + 1 < planes
              ? _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, bias), mask), bias) : X;
          const __m128i bytes = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(digit), order);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d + p * 8 + 4 * h), bytes);
          X = _mm512_srai_epi32(_mm512_sub_epi32(X, digit), 8);
        }
      }
      sum = s * (float)total;
    }
}

// One row's block of 16 outputs from its three digit planes' integer sums p0, p1, p2 (exact: their
// order does not matter), in one fixed float order: d * s * (p2 * 65536 + (p0 + p1 * 256)) + m * xs
// added to acc. The VNNI and the AMX-INT8 paths both end here, so they give the same bits.
inline __m512 add_digit_sums(__m512i p0, __m512i p1, __m512i p2, __m512 d, __m512 m, float s, float xs,
                             __m512 acc) {
  const __m512i low2 = _mm512_add_epi32(p0, _mm512_slli_epi32(p1, 8));
  const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p2), _mm512_set1_ps(65536.0f), _mm512_cvtepi32_ps(low2));
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(s)), sum, acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(xs), acc);
}

// MT rows against one group of 16 outputs of a kind-4 segment, on integer dot products over the
// three digit planes (the exact path)
template <int MT>
__attribute__((target("avx512vnni"))) void nibble_tile_vnni(
    const int32_t* digits, const float* scale, const float* xsum, int64_t nb, const uint8_t* rec,
    int64_t blocks, int64_t rec_bytes, int64_t sb, float* y, int64_t ldy, int valid) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, rec += rec_bytes) {
    fetch_ahead(rec, rec_bytes);
    __m512i codes[4][2];
    for (int k = 0; k < 4; ++k) {
      const __m512i n = _mm512_loadu_si512(rec + 64 * k);
      codes[k][0] = _mm512_and_si512(n, low);
      codes[k][1] = _mm512_and_si512(_mm512_srli_epi32(n, 4), low);
    }
    const __m512 d = load_scales(rec + Nibbles::kScalesAt, sb);
    const __m512 m = load_scales(rec + Nibbles::kScalesAt + 16 * sb, sb);
    for (int r = 0; r < MT; ++r) {
      const int32_t* w = digits + (r * nb + b) * kDigitWords;
      __m512i dot[kPlanes][2];                  // plane x half: six independent chains
      for (int p = 0; p < kPlanes; ++p)
        for (int h = 0; h < 2; ++h) {
          __m512i a = _mm512_setzero_si512();
          for (int k = 0; k < 4; ++k) a = _mm512_dpbusd_epi32(a, codes[k][h], _mm512_set1_epi32(w[p * 8 + 2 * k + h]));
          dot[p][h] = a;
        }
      acc[r] = add_digit_sums(_mm512_add_epi32(dot[0][0], dot[0][1]), _mm512_add_epi32(dot[1][0], dot[1][1]),
                              _mm512_add_epi32(dot[2][0], dot[2][1]), d, m, scale[r * nb + b], xsum[r * nb + b],
                              acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) store_lanes(y + r * ldy, acc[r], valid);
}

// ---- One digit (flags bit 1): every code kind on integer dot products against inputs rounded to
// one signed byte per block of 32 (X = round(x / s), s = max |x| / 127), as llama.cpp rounds
// activations for its integer dots (Q8_0 / Q8_1 against Q4_0 / Q4_1 / Q5_0 / Q8_0; its Q8_K for
// the K-quants rounds per 256 inputs, this per 32, so a little closer to the exact product).
// A record covers 32 inputs of 16 outputs, its codes as unsigned bytes u = c + Z laid out in the
// activation words' order (word 2k + h: inputs 8k + h + {0, 2, 4, 6}), so vpdpbusd (u8 codes x s8
// inputs) sums four products a lane; the zero point leaves the integer dot as
// sum u X - Z sum X, exact in int32, by starting the chain at -Z sum X:
//
//   kind  codes (file)     Z     record (one digit)                                  w
//   4     0..15 (Q4_*)     0     4 zmm of nibble words, d, m                         d c + m
//   5     -16..15 (Q5_0)   16    4 zmm of nibble words, 1 zmm of high bits (byte b   d c
//                                of lane o's word: bit 2k + h = input 8k + 2b + h's), d
//   8/32  int8 (Q8_0)      128   8 zmm of bytes, d                                   d c
//   8/16  -32..31 (Q6_K)   32    8 zmm of bytes, d of inputs 0-15, d of 16-31         d c
//
// acc += (d * s) * float(dot) (+ m * s sum X for kind 4): one fixed order per row, so a row's
// result is independent of the call's other rows (row-stable), on a third of the exact path's
// integer work (the planes past the first are neither written nor read).
constexpr int kOneDigitTile = 8;   // rows per pass over a group: the codes are unpacked once for them

template <int KIND, int BLK>
struct ByteCodes {
  static constexpr int64_t kScalesAt = KIND == 8 ? 512 : KIND == 5 ? 320 : 256;
  static constexpr int kZero = KIND == 5 ? 16 : KIND == 8 ? (BLK == 32 ? 128 : 32) : 0;
  __attribute__((target("avx512vnni"))) static void load(const uint8_t* rec, __m512i (&c)[8]) {
    if (KIND == 8) {
      for (int w = 0; w < 8; ++w) c[w] = _mm512_loadu_si512(rec + 64 * w);
      return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; ++k) {
      const __m512i n = _mm512_loadu_si512(rec + 64 * k);
      c[2 * k] = _mm512_and_si512(n, low);
      c[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi32(n, 4), low);
    }
    if (KIND == 5) {   // bit 4 of byte b of word p: bit 8b + p of the high word; 0xF8: a | (b & c)
      const __m512i high = _mm512_loadu_si512(rec + 256), bit4 = _mm512_set1_epi8(0x10);
      for (int p = 0; p < 8; ++p) {
        const __m512i at4 = p <= 4 ? _mm512_slli_epi32(high, 4 - p) : _mm512_srli_epi32(high, p - 4);
        c[p] = _mm512_ternarylogic_epi32(c[p], at4, bit4, 0xF8);
      }
    }
  }
};

template <int MT, int KIND, int BLK>
__attribute__((target("avx512vnni"))) void byte_tile(
    const int32_t* digits, const float* scale, const float* xsum, const int32_t* isum, int64_t nb,
    const uint8_t* rec, int64_t blocks, int64_t rec_bytes, int64_t sb, float* y, int64_t ldy, int valid) {
  using Codes = ByteCodes<KIND, BLK>;
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, rec += rec_bytes) {
    fetch_ahead(rec, rec_bytes);
    __m512i codes[8];
    Codes::load(rec, codes);
    const __m512 d0 = load_scales(rec + Codes::kScalesAt, sb);
    const __m512 d1 = (KIND == 4 || BLK == 16) ? load_scales(rec + Codes::kScalesAt + 16 * sb, sb) : d0;
    for (int r = 0; r < MT; ++r) {
      const int64_t rb = r * nb + b;
      const int32_t* w = digits + rb * kDigitWords;
      const int32_t* is = isum + 2 * rb;
      const __m512 s = _mm512_set1_ps(scale[rb]);
      if (BLK == 16) {   // chain 0: inputs 0-15 (words 0-3), chain 1: 16-31, each with its own d
        __m512i a0 = _mm512_set1_epi32(-Codes::kZero * is[0]), a1 = _mm512_set1_epi32(-Codes::kZero * is[1]);
        for (int k = 0; k < 4; ++k) {
          a0 = _mm512_dpbusd_epi32(a0, codes[k], _mm512_set1_epi32(w[k]));
          a1 = _mm512_dpbusd_epi32(a1, codes[4 + k], _mm512_set1_epi32(w[4 + k]));
        }
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d0, s), _mm512_cvtepi32_ps(a0), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d1, s), _mm512_cvtepi32_ps(a1), acc[r]);
        continue;
      }
      __m512i a0 = _mm512_set1_epi32(-Codes::kZero * (is[0] + is[1])), a1 = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {
        a0 = _mm512_dpbusd_epi32(a0, codes[2 * k], _mm512_set1_epi32(w[2 * k]));
        a1 = _mm512_dpbusd_epi32(a1, codes[2 * k + 1], _mm512_set1_epi32(w[2 * k + 1]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d0, s), _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), acc[r]);
      if (KIND == 4) acc[r] = _mm512_fmadd_ps(d1, _mm512_set1_ps(xsum[rb]), acc[r]);   // d1: the offsets m
    }
  }
  for (int r = 0; r < MT; ++r) store_lanes(y + r * ldy, acc[r], valid);
}

// ---- 4-bit codes on AMX-INT8 tiles (blocks of 8+ rows, 16 at a time; Sapphire Rapids and later)
// The same integer dot products as nibble_tile_vnni, as tile multiplies: per block of 32 inputs and
// digit plane p, C_p [rows x 16 outputs] = A_p [rows x 32 digits] . B [32 x 16 codes] (tdpbssd:
// codes 0..15 and digits are both in int8 range). B's row 2k + h is the VNNI path's codes[k][h]
// (four inputs per output), A_p's row r the plane's eight digit words of row r in the same [k][half]
// order, so C_p holds the VNNI path's dot[p][0] + dot[p][1] exactly (integer sums have no order),
// and the float steps after it are the VNNI path's (add_digit_sums): a row's result has the VNNI
// path's bits whatever the block (tests/test_quant.py compares the two bit for bit).
#if EAGLE3_AMX_BUILT
#define AMX_INT8 __attribute__((target("amx-tile,amx-int8")))
constexpr int kInt8TileRows = 16;

AMX_INT8 void amx_int8_configure(int rows) {
  static const auto table = [] {
    std::array<TileConfig, kInt8TileRows + 1> t{};
    for (int r = 1; r <= kInt8TileRows; ++r) {
      for (int i : {0, 1, 2}) { t[r].rows[i] = (uint8_t)r; t[r].colsb[i] = 64; }   // C_p: int32 x 16
      for (int i : {3, 4, 5}) { t[r].rows[i] = (uint8_t)r; t[r].colsb[i] = 32; }   // A_p: 32 digits
      t[r].rows[6] = 8; t[r].colsb[6] = 64;                                         // B: 8 x (16 x 4)
    }
    return t;
  }();
  _tile_loadconfig(&table[rows]);
}

AMX_INT8 void amx_nibble_tile(const int32_t* digits, const float* scale, const float* xsum, int64_t nb,
                              const uint8_t* rec, int64_t blocks, int64_t rec_bytes, int64_t sb, float* y,
                              int64_t ldy, int valid, int rows) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t lda = nb * kDigitWords * 4;            // bytes from one row's digits to the next's
  alignas(64) int32_t bt[8 * 16];
  alignas(64) int32_t ct[3][kInt8TileRows * 16];
  __m512 acc[kInt8TileRows];
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, rec += rec_bytes) {
    fetch_ahead(rec, rec_bytes);
    for (int k = 0; k < 4; ++k) {
      const __m512i n = _mm512_loadu_si512(rec + 64 * k);
      _mm512_store_si512(bt + 32 * k, _mm512_and_si512(n, low));
      _mm512_store_si512(bt + 32 * k + 16, _mm512_and_si512(_mm512_srli_epi32(n, 4), low));
    }
    const int32_t* a = digits + b * kDigitWords;
    _tile_loadd(6, bt, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_loadd(3, a, lda);
    _tile_loadd(4, a + 8, lda);
    _tile_loadd(5, a + 16, lda);
    _tile_dpbssd(0, 3, 6);
    _tile_dpbssd(1, 4, 6);
    _tile_dpbssd(2, 5, 6);
    _tile_stored(0, ct[0], 64);
    _tile_stored(1, ct[1], 64);
    _tile_stored(2, ct[2], 64);
    const __m512 d = load_scales(rec + Nibbles::kScalesAt, sb);
    const __m512 m = load_scales(rec + Nibbles::kScalesAt + 16 * sb, sb);
    for (int r = 0; r < rows; ++r) {
      acc[r] = add_digit_sums(_mm512_load_si512(ct[0] + 16 * r), _mm512_load_si512(ct[1] + 16 * r),
                              _mm512_load_si512(ct[2] + 16 * r), d, m, scale[r * nb + b], xsum[r * nb + b],
                              acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r) store_lanes(y + r * ldy, acc[r], valid);
}
#endif  // EAGLE3_AMX_BUILT

// whether this CPU has AMX-INT8 (CPUID 7.0 EDX bit 25; GCC 12's __builtin_cpu_supports does not
// know it) and Linux granted the tiles
bool amx_int8_available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return ((d >> 25) & 1) && ((d >> 24) & 1) && amx_permitted();
  }();
  return ok;
}

// blocks of at least this many rows run kind-4 codes on AMX-INT8 tiles, where switched on (a block
// costs ~70 cycles of tile loads, multiplies and stores whatever its rows: at 2 rows 0.077 ms against
// VNNI's 0.028 for 3072 x 576, equal at 8, 0.13 against 0.20 at 16, 0.27 against 0.39 at 32)
// (set_amx_int8: eagle3.kernels at build, from the CPU's flags and EAGLE3_AMX; same bits either way)
constexpr int64_t kInt8MinRows = 8;
std::atomic<bool> g_amx_int8{false};

// MT rows against one group of 16 outputs of a kind-8 segment with blocks of BLK inputs
template <int MT, int BLK>
void q8_tile(const float* x, int64_t ldx, const uint8_t* rec, int64_t blocks, int64_t rec_bytes,
             int64_t sb, float* y, int64_t ldy, int valid) {
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, rec += rec_bytes) {
    __m512 dot[MT][kChains];
    for (int r = 0; r < MT; ++r)
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_ps();
    const float* xb = x + b * BLK;
    fetch_ahead(rec, rec_bytes);
    for (int j = 0; j < BLK; j += kChains)
      for (int c = 0; c < kChains; ++c) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * (j + c)))));
        for (int r = 0; r < MT; ++r)
          dot[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + j + c]), w, dot[r][c]);
      }
    finish_block<MT>(dot, acc, load_scales(rec + 16 * BLK, sb));
  }
  for (int r = 0; r < MT; ++r) store_lanes(y + r * ldy, acc[r], valid);
}

// A call's rows as the tiles read them: fp32 inputs, block sums, and (flags bit 0) byte digits
struct QuantRows {
  const float* x;
  int64_t I;
  const float* xsum;         // null unless kind 4 runs on the FMA path
  int64_t nb32;
  const int32_t* digits;     // null: kind 4 on the FMA path
  const float* scale;        // per row and block: the digits' s and s * sum_j X_j
  const float* digit_sum;
  const int32_t* isum;       // one digit: per row, block and half of 16 inputs, sum_j X_j
};

template <int MT>
void quant_group(const QuantSeg& g, int64_t group, const uint8_t* base, const QuantRows& q, int64_t m0,
                 float* y, int64_t O) {
  const int64_t I = q.I, nb32 = q.nb32, blocks = I / g.block, local = group - g.group0;
  const float* x = q.x + m0 * I;
  const float* xsum = q.xsum ? q.xsum + m0 * nb32 : nullptr;   // kind 4 on FMA only
  const uint8_t* rec = base + g.offset + local * blocks * g.rec_bytes;
  const int valid = (int)std::min<int64_t>(kQuantLanes, g.out - local * kQuantLanes);
  float* yo = y + m0 * O + g.out0 + local * kQuantLanes;
  if (g.kind == 4 && q.digits)
    nibble_tile_vnni<MT>(q.digits + m0 * nb32 * kDigitWords, q.scale + m0 * nb32, q.digit_sum + m0 * nb32, nb32,
                         rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else if (g.kind == 4) nibble_tile<MT, Nibbles>(x, I, xsum, nb32, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else if (g.kind == 5) nibble_tile<MT, FiveBits>(x, I, xsum, nb32, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else if (g.block == 32) q8_tile<MT, 32>(x, I, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else q8_tile<MT, 16>(x, I, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
}

using QuantGroupFn = void (*)(const QuantSeg&, int64_t, const uint8_t*, const QuantRows&, int64_t,
                              float*, int64_t);
const QuantGroupFn kQuantGroups[kQuantTile] = {quant_group<1>, quant_group<2>, quant_group<3>, quant_group<4>};

// one digit: records of 32 inputs whatever the file's block (ByteCodes)
template <int MT>
void byte_group(const QuantSeg& g, int64_t group, const uint8_t* base, const QuantRows& q, int64_t m0,
                float* y, int64_t O) {
  const int64_t nb32 = q.nb32, local = group - g.group0;
  const uint8_t* rec = base + g.offset + local * nb32 * g.rec_bytes;
  const int valid = (int)std::min<int64_t>(kQuantLanes, g.out - local * kQuantLanes);
  float* yo = y + m0 * O + g.out0 + local * kQuantLanes;
  const int32_t* dg = q.digits + m0 * nb32 * kDigitWords;
  const float *sc = q.scale + m0 * nb32, *xs = q.digit_sum + m0 * nb32;
  const int32_t* is = q.isum + 2 * m0 * nb32;
  if (g.kind == 4) byte_tile<MT, 4, 32>(dg, sc, xs, is, nb32, rec, nb32, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else if (g.kind == 5) byte_tile<MT, 5, 32>(dg, sc, xs, is, nb32, rec, nb32, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else if (g.block == 32) byte_tile<MT, 8, 32>(dg, sc, xs, is, nb32, rec, nb32, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else byte_tile<MT, 8, 16>(dg, sc, xs, is, nb32, rec, nb32, g.rec_bytes, g.scale_bytes, yo, O, valid);
}

const QuantGroupFn kByteGroups[kOneDigitTile] = {byte_group<1>, byte_group<2>, byte_group<3>, byte_group<4>,
                                                 byte_group<5>, byte_group<6>, byte_group<7>, byte_group<8>};

}  // namespace

// x [M, I] fp32 contiguous; packed from pack_quant -> y [M, O] fp32 (+ bias)
torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                           int64_t out_features) {
  expect(x, "x", torch::kFloat32);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, I] fp32 tensor");
  const int64_t M = x.size(0), I = x.size(1), O = out_features;
  const auto header = quant_header(packed, I, O);
  const auto& segs = header.segs;
  const bool integer_dots = header.integer_dots;
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == O,
                        "bias must be fp32 [O]");
  auto y = torch::empty({M, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t nb32 = I / 32;
  const uint8_t* base = packed.data_ptr<uint8_t>();
  const bool four_bit = std::any_of(segs.begin(), segs.end(), [](const QuantSeg& g) { return g.kind == 4; });
  // each row's block sums, in one fixed order (inputs in order), for the offsets of kind-4 blocks
  // on the FMA path (integer dot products sum the rounded inputs: activation_digits; no other
  // tile reads them)
  std::vector<float> xsum;
  if (four_bit && !integer_dots) {
    xsum.resize(M * nb32);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb32; ++b) {
        float s = 0.0f;
        for (int64_t j = 0; j < 32; ++j) s += xp[r * I + b * 32 + j];
        xsum[r * nb32 + b] = s;
      }
  }
  std::vector<int32_t> digits, isum;
  std::vector<float> scale, digit_sum;
  if (integer_dots && (four_bit || header.one_digit)) {
    TORCH_CHECK(__builtin_cpu_supports("avx512vnni"),
                "packed quantized weight asks for integer dot products (AVX512-VNNI) this CPU lacks: "
                "pack it with pack_quant(..., integer_dots=False)");
    digits.resize(M * nb32 * kDigitWords);
    scale.resize(M * nb32);
    digit_sum.resize(M * nb32);
    isum.resize(2 * M * nb32);
    activation_digits(xp, M, I, digits.data(), scale.data(), digit_sum.data(), isum.data(), header.one_digit);
  }
  const QuantRows rows{xp, I, xsum.data(), nb32, digits.empty() ? nullptr : digits.data(), scale.data(),
                       digit_sum.data(), isum.data()};
  const int64_t groups = segs.back().group0 + (segs.back().out + kQuantLanes - 1) / kQuantLanes;
  float* yp = y.data_ptr<float>();
  // one digit stays on VNNI: tiles measured no faster (equal at 16-32 rows, slower at 8-12)
  const bool tiles = EAGLE3_AMX_BUILT && !digits.empty() && !header.one_digit && M >= kInt8MinRows &&
                     g_amx_int8.load();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    size_t s = 0;
    int configured = 0;
    for (int64_t grp = g0; grp < g1; ++grp) {
      while (s + 1 < segs.size() && grp >= segs[s + 1].group0) ++s;
#if EAGLE3_AMX_BUILT
      if (tiles && segs[s].kind == 4) {
        const QuantSeg& g = segs[s];
        const int64_t blocks = I / 32, local = grp - g.group0;
        const uint8_t* rec = base + g.offset + local * blocks * g.rec_bytes;
        const int valid = (int)std::min<int64_t>(kQuantLanes, g.out - local * kQuantLanes);
        for (int64_t m0 = 0; m0 < M; m0 += kInt8TileRows) {
          const int mt = (int)std::min<int64_t>(kInt8TileRows, M - m0);
          if (mt != configured) amx_int8_configure(configured = mt);
          amx_nibble_tile(rows.digits + m0 * nb32 * kDigitWords, rows.scale + m0 * nb32, rows.digit_sum + m0 * nb32,
                          nb32, rec, blocks, g.rec_bytes, g.scale_bytes, yp + m0 * O + g.out0 + local * kQuantLanes,
                          O, valid, mt);
        }
        continue;
      }
#endif
      if (header.one_digit) {
        for (int64_t m0 = 0; m0 < M; m0 += kOneDigitTile)
          kByteGroups[std::min<int64_t>(kOneDigitTile, M - m0) - 1](segs[s], grp, base, rows, m0, yp, O);
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += kQuantTile) {
        const int mt = (int)std::min<int64_t>(kQuantTile, M - m0);
        kQuantGroups[mt - 1](segs[s], grp, base, rows, m0, yp, O);
      }
    }
  });
  if (bias) y.add_(*bias);
  return y;
}

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
struct LayerWeights {
  torch::Tensor norm1, qkv_w, o_w, norm2, gate_up_w, down_w;   // packed linears (pack_weight)
  c10::optional<torch::Tensor> qkv_b, o_b;
  double eps1 = 0, eps2 = 0;
  int64_t num_heads = 0, num_kv_heads = 0, intermediate = 0;
  bool bf16 = false;
  bool amx = false;              // bf16 linears on AMX tiles (linear_bf16's amx)
};

// Rows of several sequences (continuous batching): h [1, N, H], k_buf/v_buf [slots, ...] and the
// rows' slot, cache index and key count (int64 [N] each, as rope_qkv and attention take them;
// start and mask unused): the ops of FastLayer.forward_rows, bit for bit.
torch::Tensor decoder_layer(torch::Tensor h, c10::optional<torch::Tensor> x_in, const LayerWeights& w,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor k_buf, torch::Tensor v_buf,
                            int64_t start, c10::optional<torch::Tensor> mask,
                            c10::optional<torch::Tensor> slot_of_row = c10::nullopt,
                            c10::optional<torch::Tensor> index_of_row = c10::nullopt,
                            c10::optional<torch::Tensor> keys_of_row = c10::nullopt) {
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
    TORCH_CHECK(index_of_row && keys_of_row && !mask && B == 1 && !x_in,
                "rows of several sequences: h [1, N, H], slot, index and keys of each row, no mask, no x_in");
    auto q = rope_qkv(qkv, cos, sin, k_buf, v_buf, 0, Hq, Hkv, slot_of_row, index_of_row);
    a = attention(q, k_buf, v_buf, c10::nullopt, slot_of_row, keys_of_row);
  } else {
    auto q = rope_qkv(qkv, cos, sin, k_buf, v_buf, start, Hq, Hkv);
    c10::optional<torch::Tensor> m;
    if (mask) m = mask->contiguous();
    a = attention(q, k_buf.narrow(2, 0, end), v_buf.narrow(2, 0, end), m);
  }
  auto o = linear_any(a.transpose(1, 2).reshape({B, T, Hq * D}), w.o_w, w.o_b, H, w.bf16, w.amx);
  h = h + o.view({B, T, H});
  x = rms_norm(h, w.norm2, w.eps2);
  auto gu = linear_any(x, w.gate_up_w, c10::nullopt, 2 * I, w.bf16, w.amx).view({B, T, 2 * I});
  auto parts = gu.chunk(2, -1);
  auto act = at::silu(parts[0]) * parts[1];
  auto d = linear_any(act, w.down_w, c10::nullopt, H, w.bf16, w.amx);
  return h + d.view({B, T, H});
}

// how many distinct threads an at::parallel_for region here really gets (1 if the build lost
// OpenMP; more than torch.get_num_threads() if it linked a second OpenMP runtime)
int64_t parallel_threads() {
  constexpr int kMaxIds = 1024;
  std::vector<int> seen(kMaxIds, 0);
  at::parallel_for(0, (int64_t)std::max(1, at::get_num_threads()) * 64, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    seen[std::min(std::max(t, 0), kMaxIds - 1)] = 1;
  });
  int64_t n = 0;
  for (int v : seen) n += v;
  return n;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "small-M linear: packed bf16 weight, bf16 x, fp32 out (amx: on AMX tiles)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("amx") = false);
  m.def("amx_int8_available", &amx_int8_available, "whether this CPU has AMX-INT8 and the tiles are granted");
  m.def("set_amx_int8", [](bool on) {
    TORCH_CHECK(!on || amx_int8_available(), "set_amx_int8(True): this CPU or kernel grants no AMX-INT8 tiles");
    g_amx_int8.store(on);
  }, "4-bit codes of blocks of >= 8 rows on AMX-INT8 tiles (same bits as the VNNI path)");
  m.def("amx_permitted", &amx_permitted, "whether this process may use AMX tiles (Linux grants them per process)");
  m.def("linear_fp32", &linear_fp32, "small-M linear: packed fp32 weight and x");
  m.def("linear_quant", &linear_quant, "small-M linear: GGUF codes packed by pack_quant, fp32 x and out");
  m.def("rms_norm", &rms_norm, "row-stable RMSNorm, fp32");
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
  m.def("parallel_threads", &parallel_threads, "threads that ran a parallel region");
  m.def("rope_qkv", &rope_qkv, "rotary q/k of a fused qkv block, k/v written into the cache, fp32",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_buf"), py::arg("v_buf"), py::arg("start"),
        py::arg("Hq"), py::arg("Hkv"), py::arg("slot_of_row") = py::none(), py::arg("index_of_row") = py::none());
}
