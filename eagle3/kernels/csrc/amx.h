// What the AMX tile code (linear_amx.cpp) offers the other files: the compile-time switch for AMX
// code, the target attributes of its functions, and the calls linear_float.cpp (bf16 tiles) and
// linear_quant.cpp (4-bit codes on AMX-INT8 tiles) make. It owns no kernel. AMX instructions sit
// only in functions carrying these attributes (no -mamx-* for the build; tests/test_amx.py).
#pragma once

#include "common.h"

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
#define AMX_INT8 __attribute__((target("amx-tile,amx-int8")))

namespace eagle3 {

constexpr int64_t kAmxPairs = 16;   // input pairs per tile multiply (64 bytes of A's row)

// linear_bf16(amx=true): packed bf16 [O/32, depth pairs, 32, 2] on tiles (depth % kAmxPairs == 0)
void run_amx(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t depth, const float* bias, float* y,
             int64_t M, int64_t O);

#if EAGLE3_AMX_BUILT
constexpr int kInt8TileRows = 16;

// 4-bit codes (kind 4, flags bit 0) of `rows` rows (<= kInt8TileRows) against one group of 16
// outputs; the thread's tiles must be configured for `rows` first
AMX_INT8 void amx_int8_configure(int rows);
AMX_INT8 void amx_nibble_tile(const int32_t* digits, const float* scale, const float* xsum, int64_t nb,
                              const uint8_t* rec, int64_t blocks, int64_t rec_bytes, int64_t sb, float* y,
                              int64_t ldy, int valid, int rows);
#endif  // EAGLE3_AMX_BUILT

}  // namespace eagle3
