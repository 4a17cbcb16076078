// Weight-only quantized matmuls (issue 22), registered as torch.ops.tollway_cpu.int4_matmul / int8_matmul.
//
// y [M, N] = x [M, K] @ W.T with W dequantized on the fly, never materialised; x fp32 or bf16, y in
// x's dtype; all arithmetic in fp32 with the scales and mins as given (fp32). Made for the decode
// step's small M: tiles of 4-8 weight rows against kRows activation rows at a time (independent FMA
// chains), the tile's weight rows in L1 for all passes over x's rows; from DEQUANTIZE_FROM_ROWS rows
// (kernels/quantized/cpu.py) the caller dequantizes once (the *_dequantize ops) and runs a GEMM.
//
// int4: qweight uint8 [N, K / 2] in blocks of 32 codes (16 bytes): byte j of a block holds code j in
//   its low nibble and code j + 16 in its high one (GGUF's Q4 order; kernels/quantized/cpu.py repacks
//   the layout's pairs into it). scales, mins fp32 [N, K / group] (group a multiple of 32):
//   w = q * scale + min, so y[m, n] = sum_g (scale[n, g] * sum_{k in g} x[m, k] q[n, k]) + sum_g
//   min[n, g] * xsum[m, g], with xsum computed once per call.
// int8: qweight int8 [N, K] (K a multiple of 16), scales fp32 [N]: y[m, n] = scale[n] * sum_k x[m, k] q[n, k].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t kBlock = 32;  // int4 codes per 16-byte block
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kRows = 4;  // activation rows sharing one pass over a tile of weight rows (32 vector registers)
#else
constexpr int64_t kRows = 2;  // (16 vector registers)
#endif
constexpr int64_t kGrainRows = 16;

inline float sum_all(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// The 32 codes of one int4 block as floats in k order: kBlock / W vectors.
inline void load_int4_block(const uint8_t* p, Vec* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i b = _mm512_cvtepu8_epi32(raw);
  q[0] = Vec(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))));  // codes 0..15
  q[1] = Vec(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));                     // codes 16..31
#else
  const __m256i lo = _mm256_cvtepu8_epi32(raw), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
  const __m256i mask = _mm256_set1_epi32(15);
  q[0] = Vec(_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)));  // codes 0..7
  q[1] = Vec(_mm256_cvtepi32_ps(_mm256_and_si256(hi, mask)));  // 8..15
  q[2] = Vec(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)));    // 16..23
  q[3] = Vec(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)));    // 24..31
#endif
}

// 16 int8 codes as floats: 16 / W vectors.
inline void load_int8_16(const int8_t* p, Vec* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#if defined(CPU_CAPABILITY_AVX512)
  q[0] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)));
#else
  q[0] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
  q[1] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))));
#endif
}

template <typename T>
inline void store_out(T* dst, float value) {
  *dst = static_cast<T>(value);  // c10::BFloat16 rounds to nearest even, as torch does
}

// One tile: R rows of x (fp32, row stride K) against C consecutive weight rows (row stride K / 2) ->
// y[r * N + c]. The R x C accumulators are independent FMA chains (C = 8 when R = 1, so a single
// decode row still keeps the FMA units busy); x's rows and the tile's weight rows stay in L1.
template <typename T, int64_t R, int64_t C>
inline void int4_tile(const float* x, const float* minterm, int64_t K, int64_t G, int64_t group, const uint8_t* w,
                      const float* scale, T* y, int64_t N) {
  Vec acc[R][C];
  #pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kBlock) {
      #pragma GCC unroll 8
      for (int64_t c = 0; c < C; ++c) {
        const Vec s(scale[c * G + g]);
        Vec q[kBlock / W];
        load_int4_block(w + c * (K / 2) + k0 / 2, q);
        #pragma GCC unroll 8
        for (int64_t j = 0; j < kBlock / W; ++j) {
          const Vec wv = q[j] * s;
          #pragma GCC unroll 8
          for (int64_t r = 0; r < R; ++r) {
            acc[r][c] = at::vec::fmadd(Vec::loadu(x + r * K + k0 + j * W), wv, acc[r][c]);
          }
        }
      }
    }
  }
  #pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    #pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) {
      store_out(y + r * N + c, sum_all(acc[r][c]) + minterm[r * N + c]);
    }
  }
}

template <typename T, int64_t R, int64_t C>
inline void int8_tile(const float* x, int64_t K, const int8_t* w, const float* scale, T* y, int64_t N) {
  Vec acc[R][C];
  #pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    #pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) {
      Vec q[16 / W];
      load_int8_16(w + c * K + k0, q);
      #pragma GCC unroll 8
      for (int64_t j = 0; j < 16 / W; ++j) {
        #pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          acc[r][c] = at::vec::fmadd(Vec::loadu(x + r * K + k0 + j * W), q[j], acc[r][c]);
        }
      }
    }
  }
  #pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int64_t c = 0; c < C; ++c) store_out(y + r * N + c, sum_all(acc[r][c]) * scale[c]);
}

// Calls tile.operator()<R, C>(m0, n0) over x's rows in passes of kRows for weight rows n0 .. n0 + C.
template <int64_t C, typename F>
inline void tile_rows(F& tile, int64_t M, int64_t n0) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    switch (std::min(kRows, M - m0)) {
      case 4: tile.template operator()<4, C>(m0, n0); break;
      case 3: tile.template operator()<3, C>(m0, n0); break;
      case 2: tile.template operator()<2, C>(m0, n0); break;
      default: tile.template operator()<1, C>(m0, n0);
    }
  }
}

// Every tile of weight rows [begin, end): 8 rows at a time for one x row, else 4, then single rows.
template <typename F>
inline void for_tiles(int64_t M, int64_t begin, int64_t end, F&& tile) {
  int64_t n = begin;
  if (M == 1) {
    for (; n + 8 <= end; n += 8) tile.template operator()<1, 8>(0, n);
  }
  for (; n + 4 <= end; n += 4) tile_rows<4>(tile, M, n);
  for (; n < end; ++n) tile_rows<1>(tile, M, n);
}

at::Tensor as_float_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

template <typename T>
void int4_impl(const at::Tensor& xf, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
               int64_t group, at::Tensor& out) {
  const int64_t M = xf.size(0), K = xf.size(1), N = qweight.size(0), G = K / group;
  const float* x = xf.data_ptr<float>();
  // The mins' share, sum_g min[n, g] * xsum[m, g], for all (m, n) at once: one small GEMM [M, G] x [G, N].
  at::Tensor xsum = at::empty({M, G}, xf.options());
  float* xs = xsum.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      Vec acc(0.f);
      for (int64_t k = g * group; k < (g + 1) * group; k += W) acc = acc + Vec::loadu(x + m * K + k);
      xs[m * G + g] = sum_all(acc);
    }
  }
  const at::Tensor minterm = at::mm(xsum, mins.t());
  const float* mt = minterm.data_ptr<float>();
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t begin, int64_t end) {
    for_tiles(M, begin, end, [&]<int64_t R, int64_t C>(int64_t m0, int64_t n0) {
      int4_tile<T, R, C>(x + m0 * K, mt + m0 * N + n0, K, G, group, w + n0 * K / 2, s + n0 * G, y + m0 * N + n0, N);
    });
  });
}

template <typename T>
void int8_impl(const at::Tensor& xf, const at::Tensor& qweight, const at::Tensor& scales, at::Tensor& out) {
  const int64_t M = xf.size(0), K = xf.size(1), N = qweight.size(0);
  const float* x = xf.data_ptr<float>();
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t begin, int64_t end) {
    for_tiles(M, begin, end, [&]<int64_t R, int64_t C>(int64_t m0, int64_t n0) {
      int8_tile<T, R, C>(x + m0 * K, K, w + n0 * K, s + n0, y + m0 * N + n0, N);
    });
  });
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be fp32 or bf16");
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t group) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  check_x(x, K, "int4_matmul");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "int4_matmul: qweight uint8 [N, K/2]");
  TORCH_CHECK(group % kBlock == 0 && K % group == 0, "int4_matmul: group must be a multiple of 32 dividing K");
  for (const auto* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == N && t->size(1) == K / group,
                "int4_matmul: scales and mins must be contiguous fp32 [N, K / group]");
  }
  const at::Tensor xf = as_float_rows(x);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    int4_impl<float>(xf, qweight, scales, mins, group, out);
  } else {
    int4_impl<BFloat16>(xf, qweight, scales, mins, group, out);
  }
  return out;
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  const int64_t N = qweight.size(0), K = qweight.size(1);
  check_x(x, K, "int8_matmul");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous() && K % 16 == 0,
              "int8_matmul: qweight must be contiguous int8 [N, K] with K a multiple of 16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "int8_matmul: scales must be contiguous fp32 [N]");
  const at::Tensor xf = as_float_rows(x);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    int8_impl<float>(xf, qweight, scales, out);
  } else {
    int8_impl<BFloat16>(xf, qweight, scales, out);
  }
  return out;
}


// ---- dequantization, for batches large enough that a GEMM on the float weight wins -----------
// V vectors (V * W values) to dst in T (bf16: round to nearest even, as torch does).
template <typename T, int64_t V>
inline void store_vecs(const Vec* v, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < V; ++j) v[j].store(dst + j * W);
  } else if constexpr (V % 2 == 0) {
    for (int64_t j = 0; j < V; j += 2) at::vec::convert_from_float<BFloat16>(v[j], v[j + 1]).store(dst + j * W);
  } else {
    for (int64_t j = 0; j < V; ++j) at::vec::convert_from_float<BFloat16>(v[j], v[j]).store(dst + j * W, W);
  }
}

template <typename T>
void int4_dequantize_impl(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                          int64_t group, at::Tensor& out) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2, G = K / group;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* mn = mins.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t g = n * G + k0 / group;
        Vec q[kBlock / W];
        load_int4_block(w + n * K / 2 + k0 / 2, q);
        #pragma GCC unroll 8
        for (int64_t j = 0; j < kBlock / W; ++j) q[j] = q[j] * Vec(s[g]) + Vec(mn[g]);  // as dequantize()
        store_vecs<T, kBlock / W>(q, y + n * K + k0);
      }
    }
  });
}

template <typename T>
void int8_dequantize_impl(const at::Tensor& qweight, const at::Tensor& scales, at::Tensor& out) {
  const int64_t N = qweight.size(0), K = qweight.size(1);
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k0 = 0; k0 < K; k0 += 16) {
        Vec q[16 / W];
        load_int8_16(w + n * K + k0, q);
        #pragma GCC unroll 8
        for (int64_t j = 0; j < 16 / W; ++j) q[j] = q[j] * Vec(s[n]);
        store_vecs<T, 16 / W>(q, y + n * K + k0);
      }
    }
  });
}

at::Tensor int4_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t group,
                           at::ScalarType dtype) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() && group % kBlock == 0 && K % group == 0,
              "int4_dequantize: qweight uint8 [N, K/2], group a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat && scales.is_contiguous()
              && mins.is_contiguous() && scales.numel() == N * (K / group) && mins.numel() == scales.numel(),
              "int4_dequantize: scales and mins must be contiguous fp32 [N, K / group]");
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    int4_dequantize_impl<float>(qweight, scales, mins, group, out);
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "int4_dequantize: fp32 or bf16 only");
    int4_dequantize_impl<BFloat16>(qweight, scales, mins, group, out);
  }
  return out;
}

at::Tensor int8_dequantize(const at::Tensor& qweight, const at::Tensor& scales, at::ScalarType dtype) {
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous() && K % 16 == 0,
              "int8_dequantize: qweight must be contiguous int8 [N, K] with K a multiple of 16");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "int8_dequantize: scales must be contiguous fp32 [N]");
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    int8_dequantize_impl<float>(qweight, scales, out);
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "int8_dequantize: fp32 or bf16 only");
    int8_dequantize_impl<BFloat16>(qweight, scales, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("int4_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int group) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int4_dequantize(Tensor qweight, Tensor scales, Tensor mins, int group, ScalarType dtype) -> Tensor");
  m.def("int8_dequantize(Tensor qweight, Tensor scales, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_dequantize", &int8_dequantize);
}
