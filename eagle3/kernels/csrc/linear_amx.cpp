// Linears on AMX tile multiplies (Sapphire Rapids and later), and whether this process may use the
// tiles (amx_permitted, amx_int8_available). AMX instructions only in functions with the AMX /
// AMX_INT8 attributes (amx.h; no -mamx-* for the build; tests/test_amx.py). Two kinds of weight:
//
// bf16, run_amx: linear_bf16(amx=true) runs the same packed weight as the vector path on AMX-BF16
// tile multiplies, where the CPU has them and the input width is a multiple of 32. Per 32-output
// block and 16 input pairs: the rows of x (up to 16) form tile A [rows x 32 bf16], the block's
// halves form tiles B0, B1 [16 pairs x 16 outputs x 2] (the packed rows are 128 bytes: stride 128,
// each half 64), and tdpbf16ps accumulates C0, C1 [rows x 16 fp32]. A row of C depends only on its own row of A, and
// the pairs are taken in one fixed order, so a row's result never depends on the call's other rows
// (row-stable, as the vector path; the two paths round differently, so a packed weight keeps one).
// One tile multiply does 16 x 16 x 32 products: verify blocks of 2..16 rows cost about one row.
// Tile numbers: 0, 1 = C0, C1; 2, 5 = A; 3, 4 and 6, 7 = B0, B1 (amx_block). A thread's tiles stay
// configured after a call (tilerelease would only make the next call's first load pay to wake
// them).
//
// 4-bit GGUF codes of blocks of 8+ rows, amx_nibble_tile (linear_quant picks it): the same integer dot products as nibble_tile_vnni, as tile multiplies: per block of 32 inputs and
// digit plane p, C_p [rows x 16 outputs] = A_p [rows x 32 digits] . B [32 x 16 codes] (tdpbssd:
// codes 0..15 and digits are both in int8 range). B's row 2k + h is the VNNI path's codes[k][h]
// (four inputs per output), A_p's row r the plane's eight digit words of row r in the same [k][half]
// order, so C_p holds the VNNI path's dot[p][0] + dot[p][1] exactly (integer sums have no order),
// and the float steps after it are the VNNI path's (add_digit_sums): a row's result has the VNNI
// path's bits whatever the block (tests/test_quant.py compares the two bit for bit).
//
// It does not own the packed layouts (pack_weight; quant.h) nor the choice of path (linear_float.cpp,
// linear_quant.cpp).
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "kernels.h"
#include "quant.h"

namespace eagle3 {
namespace {

constexpr int kAmxRows = 16;     // rows of x per tile pass

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
// next block, as the vector path has, was slower at one row: docs/kernels.md).
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

}  // namespace

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

#if EAGLE3_AMX_BUILT
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
    const __m512 d = load_scales(rec + kNibbleScalesAt, sb);
    const __m512 m = load_scales(rec + kNibbleScalesAt + 16 * sb, sb);
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

}  // namespace eagle3
