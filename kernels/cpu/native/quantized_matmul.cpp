// Weight-only quantized matmuls (issue 22), registered as torch.ops.tollway_cpu.int4_matmul / int8_matmul,
// and the dequantize ops their callers use for large M.
//
// y [M, N] = x [M, K] @ W.T with W dequantized on the fly, never materialised; x fp32 or bf16, y in
// x's dtype; all arithmetic in fp32 with the scales and mins as given (fp32). Made for the decode
// step's small M, where reading the weights is the cost: the weights are stored in tiles of kTile = 8
// output rows whose blocks are interleaved, so a tile is one contiguous stream (its scales another),
// and each tile is read once for all of x's rows (kRows of them per pass, the tile staying in L1).
// From DEQUANTIZE_FROM_ROWS rows (kernels/quantized/cpu.py) the caller dequantizes once (the
// *_dequantize ops) and runs a GEMM instead.
//
// Layouts (T = ceil(N / 8) tiles; rows past N are zero padding):
// int4: qweight uint8 [T, K / 32, 8, 16]: for tile t, block b (codes 32b .. 32b + 31), row c, byte j
//   holds code j in its low nibble and code j + 16 in its high one (GGUF's Q4 order). scales, mins fp32
//   [T, G, 8] (G = K / group, group a multiple of 32): w = q * scale + min, so
//   y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] q[n, k] + sum_g min[n, g] * xsum[m, g].
// int8: qweight int8 [T, K / 16, 8, 16] (K a multiple of 16), scales fp32 [T, 8]:
//   y[m, n] = scale[n] * sum_k x[m, k] q[n, k].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t kTile = 8;    // output rows interleaved per tile
constexpr int64_t kBlock = 32;  // int4 codes per 16-byte block
constexpr int64_t kBytes = 16;  // bytes of one row's block (32 int4 or 16 int8 codes)
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kRows = 2;  // rows of x per pass over a tile: 2 x 8 accumulators of 32 vector registers
#else
constexpr int64_t kRows = 1;  // 8 accumulators of 16
#endif

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

// R rows of x (fp32, row stride K) against one tile -> y[r * N + c] for its `valid` real rows.
template <typename T, int64_t R>
inline void int4_tile(const float* x, const float* xsum, int64_t K, int64_t G, int64_t group, const uint8_t* w,
                      const float* scale, const float* mins, T* y, int64_t N, int64_t valid) {
  Vec acc[R][kTile];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int64_t c = 0; c < kTile; ++c) acc[r][c] = Vec(0.f);
  const int64_t per_group = group / kBlock;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* s = scale + (b / per_group) * kTile;
    const uint8_t* wb = w + b * kTile * kBytes;
#pragma GCC unroll 8
    for (int64_t c = 0; c < kTile; ++c) {
      const Vec sc(s[c]);
      Vec q[kBlock / W];
      load_int4_block(wb + c * kBytes, q);
#pragma GCC unroll 8
      for (int64_t j = 0; j < kBlock / W; ++j) {
        const Vec wv = q[j] * sc;
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          acc[r][c] = at::vec::fmadd(Vec::loadu(x + r * K + b * kBlock + j * W), wv, acc[r][c]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    __m256 mt = _mm256_setzero_ps();  // the tile's 8 rows' sum_g min[n, g] * xsum[r, g]
    for (int64_t g = 0; g < G; ++g) {
      mt = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g * kTile), _mm256_set1_ps(xsum[r * G + g]), mt);
    }
    alignas(32) float mv[kTile];
    _mm256_store_ps(mv, mt);
    for (int64_t c = 0; c < valid; ++c) store_out(y + r * N + c, sum_all(acc[r][c]) + mv[c]);
  }
}

template <typename T, int64_t R>
inline void int8_tile(const float* x, int64_t K, const int8_t* w, const float* scale, T* y, int64_t N,
                      int64_t valid) {
  Vec acc[R][kTile];
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int64_t c = 0; c < kTile; ++c) acc[r][c] = Vec(0.f);
  for (int64_t b = 0; b < K / kBytes; ++b) {
    const int8_t* wb = w + b * kTile * kBytes;
#pragma GCC unroll 8
    for (int64_t c = 0; c < kTile; ++c) {
      Vec q[kBytes / W];
      load_int8_16(wb + c * kBytes, q);
#pragma GCC unroll 8
      for (int64_t j = 0; j < kBytes / W; ++j) {
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          acc[r][c] = at::vec::fmadd(Vec::loadu(x + r * K + b * kBytes + j * W), q[j], acc[r][c]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < valid; ++c) store_out(y + r * N + c, sum_all(acc[r][c]) * scale[c]);
}

// Calls pass.operator()<R>(m0) over x's rows in passes of kRows (the last one shorter).
template <typename F>
inline void for_row_passes(int64_t M, F&& pass) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    if constexpr (kRows >= 2) {
      if (M - m0 >= 2) {
        pass.template operator()<2>(m0);
        continue;
      }
    }
    pass.template operator()<1>(m0);
  }
}

template <typename T>
void int4_impl(const at::Tensor& xf, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
               int64_t N, int64_t group, at::Tensor& out) {
  const int64_t M = xf.size(0), K = xf.size(1), G = K / group, tiles = qweight.size(0);
  const float* x = xf.data_ptr<float>();
  at::Tensor xsum = at::empty({M, G}, xf.options());
  float* xs = xsum.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      Vec acc(0.f);
      for (int64_t k = g * group; k < (g + 1) * group; k += W) acc = acc + Vec::loadu(x + m * K + k);
      xs[m * G + g] = sum_all(acc);
    }
  }
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* mn = mins.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, valid = std::min(kTile, N - n0);
      for_row_passes(M, [&]<int64_t R>(int64_t m0) {
        int4_tile<T, R>(x + m0 * K, xs + m0 * G, K, G, group, w + t * K * kTile / 2, s + t * G * kTile,
                        mn + t * G * kTile, y + m0 * N + n0, N, valid);
      });
    }
  });
}

template <typename T>
void int8_impl(const at::Tensor& xf, const at::Tensor& qweight, const at::Tensor& scales, int64_t N, at::Tensor& out) {
  const int64_t M = xf.size(0), K = xf.size(1), tiles = qweight.size(0);
  const float* x = xf.data_ptr<float>();
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, valid = std::min(kTile, N - n0);
      for_row_passes(M, [&]<int64_t R>(int64_t m0) {
        int8_tile<T, R>(x + m0 * K, K, w + t * K * kTile, s + t * kTile, y + m0 * N + n0, N, valid);
      });
    }
  });
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
void int4_dequantize_impl(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t N,
                          int64_t group, at::Tensor& out) {
  const int64_t K = qweight.size(1) / 4, G = K / group, per_group = group / kBlock;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* mn = mins.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, qweight.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < K / kBlock; ++b) {
        for (int64_t c = 0; c < std::min(kTile, N - t * kTile); ++c) {
          const int64_t at_scale = (t * G + b / per_group) * kTile + c;
          Vec q[kBlock / W];
          load_int4_block(w + ((t * (K / kBlock) + b) * kTile + c) * kBytes, q);
#pragma GCC unroll 8
          for (int64_t j = 0; j < kBlock / W; ++j) q[j] = q[j] * Vec(s[at_scale]) + Vec(mn[at_scale]);  // as dequantize()
          store_vecs<T, kBlock / W>(q, y + (t * kTile + c) * K + b * kBlock);
        }
      }
    }
  });
}

template <typename T>
void int8_dequantize_impl(const at::Tensor& qweight, const at::Tensor& scales, int64_t N, at::Tensor& out) {
  const int64_t K = qweight.size(1) / kTile;
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, qweight.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < K / kBytes; ++b) {
        for (int64_t c = 0; c < std::min(kTile, N - t * kTile); ++c) {
          Vec q[kBytes / W];
          load_int8_16(w + ((t * (K / kBytes) + b) * kTile + c) * kBytes, q);
#pragma GCC unroll 8
          for (int64_t j = 0; j < kBytes / W; ++j) q[j] = q[j] * Vec(s[t * kTile + c]);
          store_vecs<T, kBytes / W>(q, y + (t * kTile + c) * K + b * kBytes);
        }
      }
    }
  });
}

// ---- the ops ----------------------------------------------------------------------------------
void check_tiles(const at::Tensor& qweight, at::ScalarType kind, int64_t N, int64_t K, int64_t per_row,
                 const char* op) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == kind && qweight.is_contiguous(), op,
              ": qweight must be a contiguous tile tensor [ceil(N / 8), ", per_row, " x K]");
  TORCH_CHECK(N > 0 && qweight.size(0) == (N + kTile - 1) / kTile, op, ": ", qweight.size(0), " tiles for ", N, " rows");
  TORCH_CHECK(K > 0 && K % kBytes == 0, op, ": K must be a multiple of 16, got ", K);
}

void check_scales(const at::Tensor& t, int64_t tiles, int64_t per_tile, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == tiles * per_tile, op,
              ": scales (and mins) must be contiguous fp32 tiles of ", per_tile);
}

at::Tensor as_float_rows(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, op, ": x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be fp32 or bf16");
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t N, int64_t group) {
  const int64_t K = qweight.size(1) / 4;
  check_tiles(qweight, at::kByte, N, K, 4, "int4_matmul");
  TORCH_CHECK(group % kBlock == 0 && K % group == 0, "int4_matmul: group must be a multiple of 32 dividing K");
  check_scales(scales, qweight.size(0), (K / group) * kTile, "int4_matmul");
  check_scales(mins, qweight.size(0), (K / group) * kTile, "int4_matmul");
  const at::Tensor xf = as_float_rows(x, K, "int4_matmul");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    int4_impl<float>(xf, qweight, scales, mins, N, group, out);
  } else {
    int4_impl<BFloat16>(xf, qweight, scales, mins, N, group, out);
  }
  return out;
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t N) {
  const int64_t K = qweight.size(1) / kTile;
  check_tiles(qweight, at::kChar, N, K, kTile, "int8_matmul");
  check_scales(scales, qweight.size(0), kTile, "int8_matmul");
  const at::Tensor xf = as_float_rows(x, K, "int8_matmul");
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    int8_impl<float>(xf, qweight, scales, N, out);
  } else {
    int8_impl<BFloat16>(xf, qweight, scales, N, out);
  }
  return out;
}

at::Tensor int4_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t N,
                           int64_t group, at::ScalarType dtype) {
  const int64_t K = qweight.size(1) / 4;
  check_tiles(qweight, at::kByte, N, K, 4, "int4_dequantize");
  TORCH_CHECK(group % kBlock == 0 && K % group == 0, "int4_dequantize: group must be a multiple of 32 dividing K");
  check_scales(scales, qweight.size(0), (K / group) * kTile, "int4_dequantize");
  check_scales(mins, qweight.size(0), (K / group) * kTile, "int4_dequantize");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int4_dequantize: fp32 or bf16 only");
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    int4_dequantize_impl<float>(qweight, scales, mins, N, group, out);
  } else {
    int4_dequantize_impl<BFloat16>(qweight, scales, mins, N, group, out);
  }
  return out;
}

at::Tensor int8_dequantize(const at::Tensor& qweight, const at::Tensor& scales, int64_t N, at::ScalarType dtype) {
  const int64_t K = qweight.size(1) / kTile;
  check_tiles(qweight, at::kChar, N, K, kTile, "int8_dequantize");
  check_scales(scales, qweight.size(0), kTile, "int8_dequantize");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "int8_dequantize: fp32 or bf16 only");
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(dtype));
  if (dtype == at::kFloat) {
    int8_dequantize_impl<float>(qweight, scales, N, out);
  } else {
    int8_dequantize_impl<BFloat16>(qweight, scales, N, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("int4_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int n, int group) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor qweight, Tensor scales, int n) -> Tensor");
  m.def("int4_dequantize(Tensor qweight, Tensor scales, Tensor mins, int n, int group, ScalarType dtype) -> Tensor");
  m.def("int8_dequantize(Tensor qweight, Tensor scales, int n, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_dequantize", &int8_dequantize);
}
