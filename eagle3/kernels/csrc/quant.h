// The packed GGUF-code weight, as linear_quant.cpp (its header, the FMA path, the dispatch),
// linear_quant_vnni.cpp (integer dot products) and linear_amx.cpp (AMX-INT8 tiles) share it: its
// layout, the constants and per-call row data they agree on, the helpers every code tile uses, and
// the tile tables the VNNI file exports. It owns no kernel.
//
// y[M, O] = x[M, I] @ W^T with W in the GGUF file's own integer codes, dequantized in registers.
// The packed weight (pack_quant in eagle3/kernels/__init__.py) is one uint8 tensor: an int64 header
// [magic, segments, I, O, flags] + per segment [kind, out, block, scale_bytes, rec_bytes, offset],
// then each segment's records. flags bit 0: kind-4 segments run on integer dot products; flags bit 1
// (with bit 0): one digit, every kind in its own record layout (both: linear_quant_vnni.cpp).
// A segment is a run of outputs in one format (fused q/k/v may mix them); a record covers 16
// outputs (the lanes) x one block of inputs:
//   kind 4 (Q4_0, Q4_1, Q4_K): 32 inputs, 4-bit codes c, w = scale * c + offset.
//       4 x 64 bytes: zmm k, lane o = 8 codes of output o (inputs 8k..8k+7, input 8k+j in bits
//       4j..4j+3); then 16 scales and 16 offsets (fp16 where the file's are exact in fp16, else fp32)
//   kind 5 (Q5_0): 32 inputs, 5-bit codes c, w = scale * (c - 16): the nibbles as kind 4, then
//       64 bytes (zmm lane o: bit j = input j's fifth bit), then 16 scales
//   kind 8 (Q8_0 block 32; Q6_K block 16): int8 codes c, w = scale * c.
//       block x 16 int8 (input-major, lane o = output o); then 16 scales
//
// Three paths, each row-stable (a row's result never depends on the call's other rows):
//   exact model on fp32 FMA         linear_quant.cpp        every kind (flags 0)
//   exact digits on integer dots    linear_quant_vnni.cpp   kind 4 (flags bit 0); the other kinds on
//                                   (linear_amx.cpp: blocks  FMA; the AMX-INT8 tiles give the VNNI
//                                   of 8+ rows)              path's bits
//   one digit on integer dots       linear_quant_vnni.cpp   every kind (flags bits 0 and 1)
#pragma once

#include "common.h"

namespace eagle3 {

constexpr int kPlanes = 3;                       // byte digits per activation
constexpr int kDigitWords = kPlanes * 8;         // int32 words of digits per row and block of 32
constexpr int kQuantLanes = 16;
constexpr int64_t kNibbleScalesAt = 256;        // kind 4: 16 scales after the 4 zmm of codes, then offsets
constexpr int kQuantTile = 4;    // rows per pass over a group (kChains * rows + rows accumulators)
constexpr int kOneDigitTile = 16;  // rows per pass over a group: the codes are unpacked once for them

// Each tile asks for the bytes kAhead past the record it reads, a record's worth per record: a
// thread's groups are consecutive in the packed weight, so this runs ahead of its stream, across
// groups and 4 KiB pages, where the hardware's prefetchers stop at each page. At one row the codes
// are read once and the loads wait on memory (the distances tried and their effect: docs/kernels.md).
constexpr int64_t kAhead = 4096;
inline void fetch_ahead(const uint8_t* rec, int64_t rec_bytes) {
  for (int64_t l = 0; l < rec_bytes; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec + kAhead + l), _MM_HINT_T0);
}

struct QuantSeg {
  int64_t kind, out, block, scale_bytes, rec_bytes, offset, out0, group0;
};

inline __m512 load_scales(const uint8_t* p, int64_t scale_bytes) {
  return scale_bytes == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                          : _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

inline void store_lanes(float* y, __m512 a, int valid) {
  if (valid >= 16) _mm512_storeu_ps(y, a);
  else _mm512_mask_storeu_ps(y, (__mmask16)((1u << valid) - 1), a);
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

// A packed weight's segments and paths, read (and checked) from its header: linear_quant.cpp
struct QuantPlan {
  std::vector<QuantSeg> segs;
  bool integer_dots;           // flags bit 0
  bool one_digit;              // flags bit 1 (with bit 0): inputs rounded to one byte per block
  int64_t groups;              // groups of kQuantLanes outputs over all segments
};
QuantPlan quant_plan(const torch::Tensor& packed, int64_t in_features, int64_t out_features);

using QuantGroupFn = void (*)(const QuantSeg&, int64_t, const uint8_t*, const QuantRows&, int64_t,
                              float*, int64_t);
using NibbleTileFn = void (*)(const int32_t*, const float*, const float*, int64_t, const uint8_t*, int64_t,
                              int64_t, int64_t, float*, int64_t, int);

// linear_quant_vnni.cpp: the rows' digits (one_digit: one byte per input), the exact path's kind-4
// tiles for 1..kQuantTile rows, and the one-digit groups for 1..kOneDigitTile rows
void activation_digits(const float* x, int64_t M, int64_t I, int32_t* digits, float* scale, float* xsum,
                       int32_t* isum, bool one_digit);
extern const NibbleTileFn kNibbleTilesVnni[kQuantTile];
extern const QuantGroupFn kByteGroups[kOneDigitTile];

// linear_quant.cpp: groups [g0, g1) of y [M, O] (no bias)
void quant_groups(const QuantPlan& plan, const uint8_t* base, const QuantRows& rows, int64_t M, int64_t g0,
                  int64_t g1, float* y, bool tiles);

}  // namespace eagle3
