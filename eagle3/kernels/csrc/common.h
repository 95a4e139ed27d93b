// Shared definitions of the CPU kernels in this directory: the includes, the float linears' block
// size and their output store, the argument checks every entry point runs, exp_neg (the softmax's
// and the silu's e^x), and eagle3's namespace. It owns no kernel. kernels.h declares the entry points (what bindings.cpp and layer.cpp call),
// amx.h what the AMX file offers the others, quant.h the packed GGUF-code weight.
//
// Every file is built with the same flags (eagle3/kernels/__init__.py CFLAGS): AVX-512 F/BW/VL/DQ,
// OpenMP (at::parallel_for is an OpenMP pragma in the headers), and no FMA contraction
// (-ffp-contract=off: where a kernel replaces torch ops it must round as they do). Newer instruction
// sets (AVX512-BF16, AVX512-VNNI, AMX) appear only in functions that carry their target attribute,
// so a CPU without them runs every other kernel (tests/test_kernel_build.py, tests/test_amx.py).
//
// Every kernel here computes each output in one fixed order whatever the call's other rows, so a
// row's result never depends on them (row-stable): a verify block equals one-token decode bit for
// bit.
#pragma once

#include <torch/types.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <type_traits>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace eagle3 {

constexpr int64_t kBlock = 32;   // outputs per packed block (two zmm of fp32 accumulators)

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

// e^x for x <= 0 (Cephes expf polynomial, 2^n by scalef); lanes are independent (attention's
// softmax, the MLP's silu)
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

// a CPU tensor of dtype dt, or an error naming the argument and what it got
inline void expect(const torch::Tensor& t, const char* name, c10::ScalarType dt) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU (eagle3 kernels), got ", t.device());
  TORCH_CHECK(t.scalar_type() == dt, name, " must be ", c10::toString(dt), ", got ", t.scalar_type());
}

// a KV cache's keys and values: CPU tensors, both fp32 or both fp16
inline void expect_kv(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), "the kv cache must be on the CPU (eagle3 kernels)");
  TORCH_CHECK((k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kHalf) &&
              v.scalar_type() == k.scalar_type(), "the kv cache must be fp32 or fp16 (keys and values "
              "alike), got keys ", k.scalar_type(), ", values ", v.scalar_type());
}

// the data of an int64 [n] per-row index, every value checked to lie in [lo, hi]
inline const int64_t* checked_rows(const torch::Tensor& t, const char* name, int64_t n, int64_t lo, int64_t hi) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.size(0) == n &&
              t.is_contiguous(), name, " must be a contiguous int64 CPU tensor [", n, "], got ", t.sizes());
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(p[i] >= lo && p[i] <= hi, name, "[", i, "] = ", p[i], " outside [", lo, ", ", hi, "]");
  return p;
}

}  // namespace eagle3
