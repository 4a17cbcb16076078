// Weight-only quantized matmuls (issue 22), registered as torch.ops.tollway_cpu.int4_matmul / int8_matmul.
//
// y [M, N] = x [M, K] @ W.T with W dequantized on the fly, never materialised; x fp32 or bf16, y in
// x's dtype; all arithmetic in fp32 with the scales and mins as given (fp32). Made for the decode
// step's small M: each weight row is read once per pass of kRows activation rows, which stay in L1/L2.
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

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t kBlock = 32;  // int4 codes per 16-byte block
constexpr int64_t kRows = 4;    // activation rows sharing one pass over a weight row
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

// R rows of x (fp32, row stride K) against int4 weight row n -> y[r * N + n].
template <typename T, int64_t R>
inline void int4_row(const float* x, const float* xsum, int64_t K, int64_t G, int64_t group, const uint8_t* w,
                     const float* scale, const float* mins, T* y, int64_t N) {
  Vec acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = Vec(0.f);
  for (int64_t g = 0; g < G; ++g) {
    const Vec s(scale[g]);
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kBlock) {
      Vec q[kBlock / W];
      load_int4_block(w + k0 / 2, q);
      for (int64_t j = 0; j < kBlock / W; ++j) {
        const Vec wv = q[j] * s;
        for (int64_t r = 0; r < R; ++r) acc[r] = at::vec::fmadd(Vec::loadu(x + r * K + k0 + j * W), wv, acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float total = sum_all(acc[r]);
    for (int64_t g = 0; g < G; ++g) total += mins[g] * xsum[r * G + g];
    store_out(y + r * N, total);
  }
}

template <typename T, int64_t R>
inline void int8_row(const float* x, int64_t K, const int8_t* w, float scale, T* y, int64_t N) {
  Vec acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = Vec(0.f);
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    Vec q[16 / W];
    load_int8_16(w + k0, q);
    for (int64_t j = 0; j < 16 / W; ++j) {
      for (int64_t r = 0; r < R; ++r) acc[r] = at::vec::fmadd(Vec::loadu(x + r * K + k0 + j * W), q[j], acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) store_out(y + r * N, sum_all(acc[r]) * scale);
}

// Calls body(rows, row0) over x's rows in passes of kRows (the last pass shorter).
template <typename F>
inline void for_row_blocks(int64_t M, F&& body) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) body(std::min(kRows, M - m0), m0);
}

at::Tensor as_float_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

template <typename T>
void int4_impl(const at::Tensor& xf, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
               int64_t group, at::Tensor& out) {
  const int64_t M = xf.size(0), K = xf.size(1), N = qweight.size(0), G = K / group;
  const float* x = xf.data_ptr<float>();
  std::vector<float> xsum(M * G);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      Vec acc(0.f);
      for (int64_t k = g * group; k < (g + 1) * group; k += W) acc = acc + Vec::loadu(x + m * K + k);
      xsum[m * G + g] = sum_all(acc);
    }
  }
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const float* mn = mins.data_ptr<float>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for_row_blocks(M, [&](int64_t rows, int64_t m0) {
        const float* xr = x + m0 * K;
        const float* xs = xsum.data() + m0 * G;
        const uint8_t* wr = w + n * K / 2;
        T* yr = y + m0 * N + n;
        switch (rows) {
          case 4: int4_row<T, 4>(xr, xs, K, G, group, wr, s + n * G, mn + n * G, yr, N); break;
          case 3: int4_row<T, 3>(xr, xs, K, G, group, wr, s + n * G, mn + n * G, yr, N); break;
          case 2: int4_row<T, 2>(xr, xs, K, G, group, wr, s + n * G, mn + n * G, yr, N); break;
          default: int4_row<T, 1>(xr, xs, K, G, group, wr, s + n * G, mn + n * G, yr, N);
        }
      });
    }
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
    for (int64_t n = begin; n < end; ++n) {
      for_row_blocks(M, [&](int64_t rows, int64_t m0) {
        const float* xr = x + m0 * K;
        T* yr = y + m0 * N + n;
        switch (rows) {
          case 4: int8_row<T, 4>(xr, K, w + n * K, s[n], yr, N); break;
          case 3: int8_row<T, 3>(xr, K, w + n * K, s[n], yr, N); break;
          case 2: int8_row<T, 2>(xr, K, w + n * K, s[n], yr, N); break;
          default: int8_row<T, 1>(xr, K, w + n * K, s[n], yr, N);
        }
      });
    }
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
template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_out(dst + i, src[i]);
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
    alignas(64) float block[kBlock];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
        const int64_t g = n * G + k0 / group;
        Vec q[kBlock / W];
        load_int4_block(w + n * K / 2 + k0 / 2, q);
        for (int64_t j = 0; j < kBlock / W; ++j) (q[j] * Vec(s[g]) + Vec(mn[g])).store(block + j * W);  // as dequantize()
        store_row(block, y + n * K + k0, kBlock);
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
    alignas(64) float block[16];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k0 = 0; k0 < K; k0 += 16) {
        Vec q[16 / W];
        load_int8_16(w + n * K + k0, q);
        for (int64_t j = 0; j < 16 / W; ++j) (q[j] * Vec(s[n])).store(block + j * W);
        store_row(block, y + n * K + k0, 16);
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
