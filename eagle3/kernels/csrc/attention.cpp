// attention: row-stable fp32 GQA attention over a cache prefix, softmax(q k^T / sqrt(D) + mask) v
// per query row, over one sequence's cache or over the rows of several sequences' cache slots.
// The cache holds fp32 or fp16 keys and values (fp16: widened to fp32 as they are loaded, which is
// exact, so the arithmetic after the load is the fp32 path's).
// A kv head's query heads share its keys and values in one pass; a run of query rows of one
// sequence shares one pass over the keys (a zmm lane per row and head), each row adding exactly as
// it does alone, so a row's bits never depend on the call's other rows (a tree node's, decoded in a
// verify block, equal its path's decoded alone). A lone row's heads of one kv head are lone_row,
// which the one-row layer (layer.cpp) also runs. It does not own the rotary embedding nor the cache
// write (norm_rope.cpp: rope_qkv).
#include "kernels.h"

namespace eagle3 {
namespace {

// 16 cache elements as fp32 (fp16 widens exactly); the masked form zeroes the lanes off the mask
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 maskz_load16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 maskz_load16(__mmask16 m, const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline float widen(float x) { return x; }
inline float widen(at::Half x) { return static_cast<float>(x); }

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
template <typename T>
inline __m512 dots16(const float* q, const T* k0, int64_t ldk, int64_t n, int64_t D) {
  __m512 p[16];
  const T* kr[16];
  for (int key = 0; key < 16; ++key) {
    p[key] = _mm512_setzero_ps();
    kr[key] = k0 + std::min<int64_t>(key, n - 1) * ldk;
  }
  const int64_t full = D / 16 * 16;
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int key = 0; key < 16; ++key) p[key] = _mm512_fmadd_ps(qv, load16(kr[key] + i), p[key]);
  }
  if (full < D) {
    const __mmask16 tm = (__mmask16)((1u << (D - full)) - 1);
    const __m512 qv = _mm512_maskz_loadu_ps(tm, q + full);
    for (int key = 0; key < 16; ++key)
      p[key] = _mm512_fmadd_ps(qv, maskz_load16(tm, kr[key] + full), p[key]);
  }
  return _mm512_maskz_mov_ps(n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1), reduce16(p));
}

// software prefetch into L2 of rows [0, n) of a [*, ld] matrix, D elements each (n <= 0: nothing)
template <typename T>
inline void prefetch_rows(const T* p, int64_t ld, int64_t n, int64_t D) {
  const int64_t bytes = D * (int64_t)sizeof(T);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + r * ld) + b, _MM_HINT_T1);
}

// out_i[0..16*ND) = inv_i * sum_j p_i[j * ps] * v[j] for G rows sharing v, j in order for each
// row (the same additions as one row alone: rows only share the loads of v)
template <int ND, int G, typename T>
inline void weighted_sums(const float* const* p, int64_t ps, const T* v, int64_t ldv, int64_t S,
                          const float* inv, float* const* out) {
  __m512 a[G][ND];
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) a[i][d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; ++j) {
    __m512 vj[ND];
    for (int d = 0; d < ND; ++d) vj[d] = load16(v + j * ldv + 16 * d);
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

template <int ND, typename T>
void weighted_sums_rows(const float* const* p, int64_t ps, const T* v, int64_t ldv, int64_t S,
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

// rows [0, n) of a [*, ld] fp16 matrix, D elements each (a multiple of 16), widened (exact) into
// dst [n, D]
inline void widen_rows(const at::Half* src, int64_t ld, int64_t n, int64_t D, float* dst) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + r * D + d, load16(src + r * ld + d));
}

// weighted_sums over a chunk of n values (widened, [n, 16 ND]) for lanes [i0, i0 + G) of p
// (p[j * 16 + lane], from key j0): each lane's sums continue from acc, in key order
template <int ND, int G>
inline void widened_chunk(const float* p, int64_t j0, const float* w, int64_t n, int64_t i0, float* acc) {
  __m512 a[G][ND];
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) a[i][d] = _mm512_load_ps(acc + (i0 + i) * 16 * ND + 16 * d);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vj[ND];
    for (int d = 0; d < ND; ++d) vj[d] = _mm512_load_ps(w + j * 16 * ND + 16 * d);
    for (int i = 0; i < G; ++i) {
      const __m512 pj = _mm512_set1_ps(p[(j0 + j) * 16 + i0 + i]);
      for (int d = 0; d < ND; ++d) a[i][d] = _mm512_fmadd_ps(pj, vj[d], a[i][d]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int d = 0; d < ND; ++d) _mm512_store_ps(acc + (i0 + i) * 16 * ND + 16 * d, a[i][d]);
}

// weighted_sums_rows' result (the same additions in the same order, lane by lane) over fp16
// values: a chunk of values at a time widened into L1 and used by every lane before the next
// (a conversion at every load made a pass of several rows far slower than on fp32: docs/kernels.md)
template <int ND>
void weighted_sums_widened(const float* p, const at::Half* v, int64_t ldv, int64_t S, const float* inv,
                           float* const* out, int64_t lanes) {
  constexpr int64_t D = 16 * ND, kChunk = 64;
  constexpr int G = ND <= 4 ? 4 : 2;
  alignas(64) float acc[16 * D];
  alignas(64) float wide[kChunk * D];
  std::fill(acc, acc + lanes * D, 0.0f);
  for (int64_t j0 = 0; j0 < S; j0 += kChunk) {
    const int64_t n = std::min(kChunk, S - j0);
    widen_rows(v + j0 * ldv, ldv, n, D, wide);
    int64_t i = 0;
    for (; i + G <= lanes; i += G) widened_chunk<ND, G>(p, j0, wide, n, i, acc);
    for (; i < lanes; ++i) widened_chunk<ND, 1>(p, j0, wide, n, i, acc);
  }
  for (int64_t i = 0; i < lanes; ++i) {
    const __m512 iv = _mm512_set1_ps(inv[i]);
    for (int d = 0; d < ND; ++d)
      _mm512_storeu_ps(out[i] + 16 * d, _mm512_mul_ps(_mm512_load_ps(acc + i * D + 16 * d), iv));
  }
}

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
template <int ND, typename T>
void attention_lanes(const float* const* q, float* const* out, int64_t rows, int64_t group,
                     const T* kb, int64_t ldk, const T* vb, int64_t ldv, int64_t S,
                     const bool* const* mask, const int64_t* keys, float scale, float* qt, float* sc,
                     float* wide) {
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
  // fp16 keys: lane_dots2 reads a key one element at a time, so each chunk of keys is widened
  // (exact) into a buffer that stays in L1 first (the values likewise: weighted_sums_widened)
  constexpr int64_t kChunk = 64;     // `wide` holds kChunk * D floats (heap scratch: as a local
                                     // array the compiler moved its elements through the stack)
  for (int64_t s = 0; s < S; s += 2) {
    const bool pair = s + 1 < S;
    const float* k0;
    int64_t step;
    if constexpr (std::is_same_v<T, float>) {
      k0 = kb + s * ldk, step = ldk;
    } else {
      if (s % kChunk == 0) widen_rows(kb + s * ldk, ldk, std::min(kChunk, S - s), D, wide);
      k0 = wide + (s % kChunk) * D, step = D;
    }
    __m512 d0, d1;
    lane_dots2<ND>(qt, k0, pair ? k0 + step : k0, d0, d1);
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
  if constexpr (std::is_same_v<T, float>)
    weighted_sums_rows<ND>(p, 16, vb, ldv, S, inv, out, lanes);
  else
    weighted_sums_widened<ND>(sc, vb, ldv, S, inv, out, lanes);
}

}  // namespace

// One query row of one kv head's `heads` query heads (qrow, orow in `s`) over keys [0, S) where
// the mask row (if any) lets it: scores, max, exponentials, a sum over the keys in order, the
// weighted sums in order. Every head's arithmetic is its own (heads share only the loads of the
// values), so a head gets the same bits in an item of one head or of its whole group, and the
// same as its lane in attention_lanes. nk, nv, nS: the next item's keys and values, prefetched a
// share per block of 16 keys (null: none).
template <typename KV>
void lone_row(int64_t heads, const KV* kb, int64_t ldk, const KV* vb, int64_t ldv, int64_t S, int64_t D,
              const bool* mr, float scale, const KV* nk, const KV* nv, int64_t nS, RowScratch& s) {
  const int64_t ld = S + 16;                 // one score row per head
  if ((int64_t)s.sc.size() < heads * ld) s.sc.resize(heads * ld);
  float* sc = s.sc.data();
  float* mx = s.mx.data();
  for (int64_t i = 0; i < heads; ++i) {
    s.prow[i] = sc + i * ld;
    mx[i] = -INFINITY;
  }
  for (int64_t s0 = 0; s0 < S; s0 += 16) {
    const int64_t n = std::min<int64_t>(16, S - s0);
    if (nk) {
      const int64_t lo = s0 * nS / S, hi = std::min<int64_t>(S, s0 + 16) * nS / S;
      prefetch_rows(nk + lo * ldk, ldk, hi - lo, D);
      prefetch_rows(nv + lo * ldv, ldv, hi - lo, D);
    }
    __mmask16 live = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    if (mr)
      for (int64_t j = 0; j < n; ++j)
        if (!mr[s0 + j]) live &= (__mmask16)~(1u << j);
    for (int64_t i = 0; i < heads; ++i) {
      const __m512 x = _mm512_mul_ps(dots16(s.qrow[i], kb + s0 * ldk, ldk, n, D), _mm512_set1_ps(scale));
      const __m512 xs = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, x);
      _mm512_storeu_ps(sc + i * ld + s0, xs);
      mx[i] = std::max(mx[i], _mm512_reduce_max_ps(xs));
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    float* si = sc + i * ld;
    for (int64_t k = 0; k < S; k += 16) {
      const __mmask16 m = S - k >= 16 ? 0xFFFF : (__mmask16)((1u << (S - k)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(m, si + k);
      const __mmask16 live = _mm512_mask_cmp_ps_mask(m, x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      _mm512_mask_storeu_ps(si + k, m, _mm512_maskz_mov_ps(live, exp_neg(_mm512_sub_ps(x, _mm512_set1_ps(mx[i])))));
    }
  }
  // sums run over the keys in order, one at a time: masked keys add exact zeros, so a tree
  // node whose ancestors sit between masked siblings gets the bits of its path decoded alone
  // (in registers, up to three rows' chains interleaved)
  float* sum = s.sum.data();
  for (int64_t i = 0; i < heads;) {
    const float* r0p = sc + i * ld;
    if (heads - i >= 3) {
      const float *r1p = r0p + ld, *r2p = r1p + ld;
      float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f;
      for (int64_t k = 0; k < S; ++k) a0 += r0p[k], a1 += r1p[k], a2 += r2p[k];
      sum[i] = a0, sum[i + 1] = a1, sum[i + 2] = a2;
      i += 3;
    } else {
      float a0 = 0.0f;
      for (int64_t k = 0; k < S; ++k) a0 += r0p[k];
      sum[i++] = a0;
    }
  }
  // a row that may attend to nothing (padding) gets zeros, as SDPA gives, not 0 * inf = NaN
  float* inv = s.inv.data();
  for (int64_t i = 0; i < heads; ++i) inv[i] = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
  if (D == 64) {
    weighted_sums_rows<4>(s.prow.data(), 1, vb, ldv, S, inv, s.orow.data(), heads);
  } else if (D == 128) {
    weighted_sums_rows<8>(s.prow.data(), 1, vb, ldv, S, inv, s.orow.data(), heads);
  } else {
    if ((int64_t)s.acc.size() < D) s.acc.resize(D);
    float* acc = s.acc.data();
    for (int64_t i = 0; i < heads; ++i) {
      std::fill(acc, acc + D, 0.0f);
      for (int64_t j = 0; j < S; ++j) {
        const KV* vr = vb + j * ldv;
        for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(s.prow[i][j], widen(vr[d]), acc[d]);
      }
      for (int64_t d = 0; d < D; ++d) s.orow[i][d] = acc[d] * inv[i];
    }
  }
}

template void lone_row<float>(int64_t, const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                              const bool*, float, const float*, const float*, int64_t, RowScratch&);
template void lone_row<at::Half>(int64_t, const at::Half*, int64_t, const at::Half*, int64_t, int64_t, int64_t,
                                 const bool*, float, const at::Half*, const at::Half*, int64_t, RowScratch&);

// Work items and their scratch: AttnJob (kernels.h)
void AttnJob::build(int64_t threads) {
  // Work items: one kv head's `group` query heads at a run of query rows of one sequence. A run of
  // rows shares one pass over the keys (attention_lanes: up to 16 / group rows, a lane per row and
  // head) where D is 64 or 128; else, and for a lone row, a row is an item of its own. A pass costs
  // about what two rows alone cost whatever its lanes, so runs of 1-2 rows go row by row, longer
  // ones in as few passes as the lanes allow, at least one item per thread (measured:
  // docs/kernels.md).
  // A lone row's item may hold only some of its group's heads (h0, hn): a decode step has one
  // item per kv head (3 for SmolLM2, on 2 threads one of them ran two), so where items are few
  // each head is an item of its own. A head's arithmetic is the same either way (its heads share
  // only the loads of the values), so the bits do not change.
  const int64_t lane_rows = (D == 64 || D == 128) && group <= 8 ? 16 / group : 1;
  const int64_t min_blocks = (threads + B * Hkv - 1) / (B * Hkv);  // a thread each
  items.clear();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t t = 0; t < T;) {
        int64_t run = 1;                     // rows of one slot (all rows without slots)
        while (t + run < T && (!rows || row_slot[t + run] == row_slot[t])) ++run;
        const int64_t nb = lane_rows == 1 || run < 3 ? run
            : std::min(run, std::max((run + lane_rows - 1) / lane_rows, min_blocks));
        for (int64_t i = 0; i < nb; ++i)     // blocks as even as possible
          items.push_back({b, g, t + run * i / nb, run * (i + 1) / nb - run * i / nb, 0, group});
        t += run;
      }
  if (threads > 1 && group > 1 && (int64_t)items.size() < 2 * threads) {   // lone rows: a head each
    std::vector<AttnItem> heads;
    for (const AttnItem& it : items) {
      if (it.n > 1) heads.push_back(it);
      else
        for (int64_t i = 0; i < group; ++i) heads.push_back({it.b, it.g, it.t0, 1, i, 1});
    }
    items.swap(heads);
  }
}

void AttnJob::run(int64_t r0, int64_t r1) const {
  auto go = [&](const auto* kp, const auto* vp) {
    using KV = std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>;
    RowScratch scratch(group);
    std::vector<float> qt, sc16;
    // attention_lanes' scratch for fp16 values (no zero fill: it writes before it reads)
    std::unique_ptr<float[]> wide(std::is_same_v<KV, float> ? nullptr : new float[64 * D + 16]);
    for (int64_t r = r0; r < r1; ++r) {
      const AttnItem& it = items[r];
      const int64_t b = it.b, g = it.g, t = it.t0;
      const int64_t kv_b = rows ? row_slot[t] : b;
      const KV* kb = kp + kv_b * ks[0] + g * ks[1];
      const KV* vb = vp + kv_b * vs[0] + g * vs[1];
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
          attention_lanes<4>(lq.data(), lo.data(), n, group, kb, ks[2], vb, vs[2], S,
                             lm.data(), lk.data(), scale, qt.data(), sc16.data(), wide.get());
        else
          attention_lanes<8>(lq.data(), lo.data(), n, group, kb, ks[2], vb, vs[2], S,
                             lm.data(), lk.data(), scale, qt.data(), sc16.data(), wide.get());
        continue;
      }
      const int64_t S = rows ? row_keys[t] : S_all;
      const bool* mr = mp ? mp + b * mask_b + t * S_all : nullptr;
      // the cache rows come from memory (a batch's slots far exceed the caches): the next item's
      // keys and values stream in while this one computes its scores (lone_row)
      const KV *nk = nullptr, *nv = nullptr;
      int64_t nS = 0;
      if (r + 1 < r1) {
        const AttnItem& nx = items[r + 1];
        const int64_t nkv = rows ? row_slot[nx.t0] : nx.b;
        nS = rows ? row_keys[nx.t0] : S_all;
        nk = kp + nkv * ks[0] + nx.g * ks[1];
        nv = vp + nkv * vs[0] + nx.g * vs[1];
      }
      const int64_t heads = it.hn;           // the item's heads of the group: h0 .. h0 + hn - 1
      for (int64_t i = 0; i < heads; ++i) {
        const int64_t row = (b * Hq + g * group + it.h0 + i) * T + t;
        scratch.qrow[i] = qp + row * D;
        scratch.orow[i] = op + row * D;
      }
      lone_row(heads, kb, ks[2], vb, vs[2], S, D, mr, scale, nk, nv, nS, scratch);
    }
  };
  if (half) go(static_cast<const at::Half*>(kp_), static_cast<const at::Half*>(vp_));
  else go(static_cast<const float*>(kp_), static_cast<const float*>(vp_));
}

// q [B, Hq, T, D] fp32 contiguous; k, v [B, Hkv, S, D] fp32 views with unit stride on D (a cache
// prefix); mask: None, or bool broadcastable as [B|1, 1, T, S] contiguous (True = may attend).
// One work item is the `group` query heads of one kv head at one query position: they share
// every k and v row, and their independent dot products and sums keep the core busy. Each row's
// arithmetic is the same whatever else is in the item.
// Rows of several sequences (continuous batching): q [1, Hq, N, D] holds N rows, k/v [slots, Hkv,
// S, D] a cache slot per sequence; row t attends to keys [0, keys_of_row[t]) of slot
// slot_of_row[t] (int64 [N] each) where the mask, if any ([1, 1, N, S] bool: a tree block's rows
// see their ancestors only), lets it. Same arithmetic as a masked block: masked keys only add exact
// zeros there, so a row gets the bits of its sequence run alone.
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                        c10::optional<torch::Tensor> slot_of_row,
                        c10::optional<torch::Tensor> keys_of_row) {
  expect(q, "q", torch::kFloat32);
  expect_kv(k, v);
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
  TORCH_CHECK(!rows || B == 1, "rows of several sequences: q must be [1, Hq, N, D]");
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
  AttnJob job;
  job.B = B, job.Hq = Hq, job.T = T, job.D = D, job.Hkv = Hkv, job.S_all = S_all, job.group = group;
  job.rows = rows, job.row_slot = row_slot, job.row_keys = row_keys, job.mp = mp, job.mask_b = mask_b;
  job.qp = q.data_ptr<float>(), job.op = out.data_ptr<float>(), job.scale = 1.0f / std::sqrt((float)D);
  job.half = k.scalar_type() == torch::kHalf;
  job.kp_ = k.data_ptr(), job.vp_ = v.data_ptr();
  for (int i = 0; i < 3; ++i) job.ks[i] = k.stride(i), job.vs[i] = v.stride(i);
  job.build(std::max(1, at::get_num_threads()));
  at::parallel_for(0, (int64_t)job.items.size(), 1, [&](int64_t r0, int64_t r1) { job.run(r0, r1); });
  return out;
}

}  // namespace eagle3
