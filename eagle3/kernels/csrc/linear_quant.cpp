// linear_quant: y[M, O] = x[M, I] @ W^T (+ bias) with W in a GGUF file's own integer codes, packed by
// pack_quant (the layout: quant.h). This file owns the packed header's checks, the exact path on
// fp32 FMA for every code kind (the path of CPUs without AVX512-VNNI and of weights packed with
// integer_dots=False), the AMX-INT8 switch (set_amx_int8), and each call's work: the rows' block
// sums or digits, and which tile runs each group of 16 outputs (quant_plan reads the header,
// quant_groups runs a range of groups: the one-row layer runs its share with them). It does not own the integer dot
// products (linear_quant_vnni.cpp) nor the AMX-INT8 tiles (linear_amx.cpp).
//
// Per block and row: dot = sum_j x_j c_j (fp32 FMA, kChains interleaved partial sums), then
// acc = scale * dot (+ offset * sum_j x_j) (the block's input sum, computed once per row): the
// exact model of the file up to fp32 rounding, and each row in one fixed order whatever the call's
// other rows (row-stable, as the bf16 kernels).
#include "amx.h"
#include "kernels.h"
#include "quant.h"

namespace eagle3 {
namespace {

constexpr int64_t kQuantMagic = 0x5451474746;   // "FGGQT": the header with flags
constexpr int64_t kHeaderWords = 5;

QuantPlan quant_header(const torch::Tensor& packed, int64_t in_features, int64_t out_features) {
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
  return {segs, (h[4] & 1) != 0, (h[4] & 2) != 0, group0};
}

// Each row's block dot product runs as kChains interleaved partial sums (input j into chain
// j % kChains, added (0+1)+(2+3) at the block's end): one chain would wait on the FMA latency every
// step at M = 1. The same for every tile size, so a row's bits never depend on M.
constexpr int kChains = 4;

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
  static constexpr int64_t kScalesAt = kNibbleScalesAt;
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

// blocks of at least this many rows run kind-4 codes on AMX-INT8 tiles, where switched on: a block
// costs a fixed run of tile loads, multiplies and stores whatever its rows, so the tiles lose to
// VNNI below it (the crossover measured: docs/kernels.md)
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
    kNibbleTilesVnni[MT - 1](q.digits + m0 * nb32 * kDigitWords, q.scale + m0 * nb32, q.digit_sum + m0 * nb32,
                             nb32, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else if (g.kind == 4) nibble_tile<MT, Nibbles>(x, I, xsum, nb32, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else if (g.kind == 5) nibble_tile<MT, FiveBits>(x, I, xsum, nb32, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else if (g.block == 32) q8_tile<MT, 32>(x, I, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
  else q8_tile<MT, 16>(x, I, rec, blocks, g.rec_bytes, g.scale_bytes, yo, O, valid);
}

const QuantGroupFn kQuantGroups[kQuantTile] = {quant_group<1>, quant_group<2>, quant_group<3>, quant_group<4>};

}  // namespace

QuantPlan quant_plan(const torch::Tensor& packed, int64_t in_features, int64_t out_features) {
  return quant_header(packed, in_features, out_features);
}

// The groups [g0, g1) of y [M, O] from the rows' inputs: linear_quant's parallel body (no bias),
// and a share of a linear in the one-row layer's region (layer.cpp). tiles: 4-bit codes of blocks
// of 8+ rows on AMX-INT8 (the caller decides).
void quant_groups(const QuantPlan& plan, const uint8_t* base, const QuantRows& rows, int64_t M, int64_t g0,
                  int64_t g1, float* yp, bool tiles) {
  const auto& segs = plan.segs;
  const int64_t nb32 = rows.nb32, O = segs.back().out0 + segs.back().out;
  size_t s = 0;
  int configured = 0;
  (void)tiles, (void)configured;
  for (int64_t grp = g0; grp < g1; ++grp) {
    while (s + 1 < segs.size() && grp >= segs[s + 1].group0) ++s;
#if EAGLE3_AMX_BUILT
    if (tiles && segs[s].kind == 4) {
      const QuantSeg& g = segs[s];
      const int64_t blocks = rows.I / 32, local = grp - g.group0;
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
    if (plan.one_digit) {
      // the fewest passes, their rows spread evenly: 17 rows run as 9 + 8, not 16 + 1 (a pass
      // unpacks the group's codes once, whatever its rows)
      const int64_t passes = (M + kOneDigitTile - 1) / kOneDigitTile;
      for (int64_t p = 0, m0 = 0; p < passes; ++p) {
        const int64_t mt = M / passes + (p < M % passes ? 1 : 0);
        kByteGroups[mt - 1](segs[s], grp, base, rows, m0, yp, O);
        m0 += mt;
      }
      continue;
    }
    for (int64_t m0 = 0; m0 < M; m0 += kQuantTile) {
      const int mt = (int)std::min<int64_t>(kQuantTile, M - m0);
      kQuantGroups[mt - 1](segs[s], grp, base, rows, m0, yp, O);
    }
  }
}

void set_amx_int8(bool on) {
  TORCH_CHECK(!on || amx_int8_available(), "set_amx_int8(True): this CPU or kernel grants no AMX-INT8 tiles");
  g_amx_int8.store(on);
}

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
  float* yp = y.data_ptr<float>();
  // one digit stays on VNNI: tiles measured no faster there (docs/kernels.md)
  const bool tiles = EAGLE3_AMX_BUILT && !digits.empty() && !header.one_digit && M >= kInt8MinRows &&
                     g_amx_int8.load();
  at::parallel_for(0, header.groups, 1, [&](int64_t g0, int64_t g1) {
    quant_groups(header, base, rows, M, g0, g1, yp, tiles);
  });
  if (bias) y.add_(*bias);
  return y;
}

}  // namespace eagle3
