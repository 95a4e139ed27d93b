// GGUF codes on AVX512-VNNI integer dot products: the rows' inputs as byte digits
// (activation_digits), the exact three-digit path for 4-bit codes (nibble_tile_vnni) and the
// one-digit path for every code kind (byte_tile, its own record layout). VNNI instructions sit only
// in target("avx512vnni") functions, so a CPU without VNNI runs every other kernel. It does not
// decide which path a weight takes (linear_quant.cpp, through quant.h's tables), nor own the
// AMX-INT8 tiles (linear_amx.cpp), which read the same digits and end in add_digit_sums for the
// same bits.
//
// Kind 4 on integer dot products (flags bit 0): the FMA path spends ~3 vector ops a weight turning
// nibbles into floats and is compute-bound at M = 1, below what the memory delivers
// (docs/kernels.md). Here each row's block of 32 inputs becomes integers X = round(x / s), with
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
// integer dots, for every code kind (byte_tile: its own record layout), so a block costs a third
// of the integer dot products and the inputs move by up to s / 2 (~0.4% of the block's
// largest). `--weights gguf-exact` keeps the exact path.
#include "quant.h"

#include <chrono>

namespace eagle3 {
namespace {

constexpr float kDigitMax = 8355000.0f;          // < 127 * (65536 + 256 + 1): d2 never leaves int8
constexpr float kOneDigitMax = 127.0f;           // one digit: X itself is the byte

}  // namespace

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

namespace {

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
    const __m512 d = load_scales(rec + kNibbleScalesAt, sb);
    const __m512 m = load_scales(rec + kNibbleScalesAt + 16 * sb, sb);
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

}  // namespace

// ---- The integer-dot roofline: how many vpdpbusd (zmm, 64 byte products each) this CPU retires a
// second over the parallel region's threads, on ten independent chains a thread (no memory).
// A row of one-digit codes needs in x out / 64 of them, so an extra verify row cannot cost less
// than that count over this rate (bench.roofline reports it beside the memory bound).

namespace {

__attribute__((target("avx512vnni"))) int32_t dot_burst(int64_t reps) {
  __m512i a[10];
  const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-5);
  for (int i = 0; i < 10; ++i) a[i] = _mm512_set1_epi32(i);
  for (int64_t n = 0; n < reps; ++n) {
    for (int i = 0; i < 10; ++i) a[i] = _mm512_dpbusd_epi32(a[i], u, s);
    __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]),
                     "+v"(a[6]), "+v"(a[7]), "+v"(a[8]), "+v"(a[9]));
  }
  __m512i t = a[0];
  for (int i = 1; i < 10; ++i) t = _mm512_add_epi32(t, a[i]);
  return _mm512_reduce_add_epi32(t);
}

}  // namespace

double integer_dot_peak(int64_t reps) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni"), "integer_dot_peak needs AVX512-VNNI, which this CPU lacks");
  TORCH_CHECK(reps > 0, "integer_dot_peak: reps must be positive, got ", reps);
  const int64_t threads = std::max(1, at::get_num_threads());
  std::vector<double> rate(threads, 0.0);
  std::atomic<int32_t> sink{0};                          // the chains' sums, so they are computed
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      sink += dot_burst(reps / 10 + 1);                  // warm-up: clocks and the pipes
      const auto start = std::chrono::steady_clock::now();
      sink += dot_burst(reps);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      rate[t] = 10.0 * (double)reps / s;
    }
  });
  double total = 0.0;
  for (double r : rate) total += r;
  return total;
}

const NibbleTileFn kNibbleTilesVnni[kQuantTile] = {nibble_tile_vnni<1>, nibble_tile_vnni<2>, nibble_tile_vnni<3>,
                                                   nibble_tile_vnni<4>};
const QuantGroupFn kByteGroups[kOneDigitTile] = {
    byte_group<1>,  byte_group<2>,  byte_group<3>,  byte_group<4>,  byte_group<5>,  byte_group<6>,
    byte_group<7>,  byte_group<8>,  byte_group<9>,  byte_group<10>, byte_group<11>, byte_group<12>,
    byte_group<13>, byte_group<14>, byte_group<15>, byte_group<16>};

}  // namespace eagle3
