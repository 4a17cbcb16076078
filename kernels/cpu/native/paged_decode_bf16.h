// paged_decode.cpp's kernels on AVX512-BF16's vdpbf16ps, for a bf16 model over a bf16 cache: the scores and
// the V sum of a (sequence, KV head) task's query heads, and a whole sequence's every KV head in one task.
#pragma once

#include "paged_decode.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
namespace tollway_native {

// out[t] = the sum of a[t]'s 16 lanes, t < 8: three rounds of 128-bit-lane shuffles and adds, 3 instructions
// a token where reduce4's extracts and hadds took 5 (the score loop's largest cost after its dot products).
TOLLWAY_BF16_DOT inline void reduce8(const __m512 a[8], float* out) {
  __m512 pair[4];  // pair[p]: tokens 2p and 2p+1, 8 partial sums each (lanes 0-1 and 2-3 of 128 bits)
  for (int64_t p = 0; p < 4; ++p) {
    pair[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                            _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xee));
  }
  // quad[0]: 128-bit lane k holds token k's 4 partial sums; quad[1] token k + 4's.
  const __m512 quad0 = _mm512_add_ps(_mm512_shuffle_f32x4(pair[0], pair[1], 0x88),
                                     _mm512_shuffle_f32x4(pair[0], pair[1], 0xdd));
  const __m512 quad1 = _mm512_add_ps(_mm512_shuffle_f32x4(pair[2], pair[3], 0x88),
                                     _mm512_shuffle_f32x4(pair[2], pair[3], 0xdd));
  // Lane k: [k 0+2, k+4 0+2, k 1+3, k+4 1+3], then + its halves swapped: [k, k+4, k, k+4] whole.
  const __m512 mixed = _mm512_add_ps(_mm512_unpacklo_ps(quad0, quad1), _mm512_unpackhi_ps(quad0, quad1));
  const __m512 sums = _mm512_add_ps(mixed, _mm512_permute_ps(mixed, 0x4e));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums)));
}

// The scores of NG query heads (q: head g's D values at q + g * q_stride), bf16 against a bf16 cache,
// with AVX512-BF16 dot products: each vdpbf16ps multiplies 32 bf16 pairs exactly and sums them in pairs
// into 16 fp32 lanes, replacing the widening of every K row to fp32 and its two multiply-adds.
// With `heads` > 1 (sequence_task), the same for that many KV heads, each token's rows of them read
// together: KV head h's rows lie row_stride elements after head 0's (t.rows), its query heads follow
// the ones before (q + h * NG * q_stride) and its scores too (t.s + h * NG * t.L).
// Eight tokens a pass where their NG x 8 accumulators fit the registers (reduce8), else four (reduce4).
template <int64_t D, int64_t NG>
TOLLWAY_BF16_DOT void scores_bf16(const BFloat16* q, int64_t q_stride, TaskRows<BFloat16> t, int64_t heads = 1,
                                  int64_t row_stride = 0) {
  static_assert(D % 32 == 0, "32 bf16 values per vector");
  constexpr int64_t T = NG <= 3 ? 8 : 4;  // tokens a pass: NG * T accumulators, NG queries and a row <= 32
  auto row = [&](int64_t token, int64_t h, int64_t j) {
    return (__m512bh)_mm512_loadu_si512(t.kp + t.rows[token] + h * row_stride + 32 * j);
  };
  auto query = [&](int64_t h, int64_t g, int64_t j) {
    return (__m512bh)_mm512_loadu_si512(q + (h * NG + g) * q_stride + 32 * j);
  };
  const int64_t fetched_bytes = ((heads - 1) * row_stride + D) * 2;  // head 0's row to the last head's end
  int64_t i = 0;
  for (; i + T <= t.n; i += T) {
    if (t.prefetch) {
      for (int64_t u = 0; u < T; u += 4) prefetch_ahead(t.kp, t.vp, t.rows, i + u, t.n, fetched_bytes);
    }
    for (int64_t h = 0; h < heads; ++h) {
      __m512 a[NG][T];
      for (int64_t g = 0; g < NG; ++g) {
        for (int64_t u = 0; u < T; ++u) a[g][u] = _mm512_setzero_ps();
      }
#pragma GCC unroll 8
      for (int64_t j = 0; j < D / 32; ++j) {
        __m512bh qv[NG];
        for (int64_t g = 0; g < NG; ++g) qv[g] = query(h, g, j);
#pragma GCC unroll 8
        for (int64_t u = 0; u < T; ++u) {
          const __m512bh k = row(i + u, h, j);
#pragma GCC unroll 8
          for (int64_t g = 0; g < NG; ++g) a[g][u] = _mm512_dpbf16_ps(a[g][u], qv[g], k);
        }
      }
      float* s = t.s + h * NG * t.L;
      for (int64_t g = 0; g < NG; ++g) {
        if constexpr (T == 8) {
          reduce8(a[g], s + g * t.L + i);
        } else {
          reduce4(Vec(a[g][0]), Vec(a[g][1]), Vec(a[g][2]), Vec(a[g][3]), s + g * t.L + i);
        }
      }
    }
  }
  for (; i < t.n; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t g = 0; g < NG; ++g) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t j = 0; j < D / 32; ++j) a = _mm512_dpbf16_ps(a, query(h, g, j), row(i, h, j));
        t.s[(h * NG + g) * t.L + i] = _mm512_reduce_add_ps(a);
      }
    }
  }
}

// Vectors of 32 bf16 of a V row summed per pass over the tokens for NG heads: two accumulators per vector
// and head, the pair of rows' two interleaved halves and NG probabilities must fit the 32 registers.
template <int64_t J, int64_t NG>
constexpr int64_t bf16_value_chunk() {
  int64_t k = J;
  while (k > 1 && 2 * NG * k + 2 * k + NG > 32) k /= 2;
  return k;
}

// value_sum (below) for a bf16 cache, with AVX512-BF16 dot products over pairs of tokens: each vdpbf16ps adds
// p_i v_i[d] + p_i+1 v_i+1[d] for 16 dims, the two rows interleaved 16 bits at a time. The probabilities are
// rounded to bf16 first (relative error 2^-9, as the attention's bf16 output itself rounds; flash attention's
// GPU kernels round P for the same product); the products are exact and summed in fp32. It halves the
// instructions of the fp32 sum, which widens every V row and spends one multiply-add per value and head.
template <int64_t D, int64_t NG>
TOLLWAY_BF16_DOT void value_sum_bf16(TaskRows<BFloat16> t, const float* inv, float* acc) {
  static_assert(D % 32 == 0, "32 bf16 values per vector");
  constexpr int64_t J = D / 32, K = bf16_value_chunk<J, NG>();
  const int64_t n_padded = (t.n + W - 1) / W * W;  // the softmax left zeros up to here: p_n = 0 pairs a lone last token
  for (int64_t g = 0; g < NG; ++g) {
    for (int64_t i = 0; i < n_padded; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.probs16 + g * t.L + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(t.s + g * t.L + i)));
    }
  }
  alignas(64) static const BFloat16 zeros[D] = {};  // the row beside a lone last token (its p is 0)
  for (int64_t d = 0; d < D; d += 32 * K) {
    __m512 lo[NG][K], hi[NG][K];
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t j = 0; j < K; ++j) lo[g][j] = hi[g][j] = _mm512_setzero_ps();
    }
    const bool fetch_next = d == 0 && t.next_n > 0;
    for (int64_t i = 0; i < t.n; i += 2) {
      if (fetch_next) prefetch_rows(t.kp, t.next_rows, std::min(i, t.next_n), std::min(i + 2, t.next_n), D * 2);
      const BFloat16* r0 = t.vp + t.rows[i] + d;
      const BFloat16* r1 = i + 1 < t.n ? t.vp + t.rows[i + 1] + d : zeros + d;
      __m512bh p[NG];
      for (int64_t g = 0; g < NG; ++g) {
        int32_t pair;
        std::memcpy(&pair, t.probs16 + g * t.L + i, sizeof(pair));  // p_i in the low half, p_i+1 in the high
        p[g] = (__m512bh)_mm512_set1_epi32(pair);
      }
#pragma GCC unroll 8
      for (int64_t j = 0; j < K; ++j) {
        const __m512i a = _mm512_loadu_si512(r0 + 32 * j), b = _mm512_loadu_si512(r1 + 32 * j);
        const __m512bh ab_lo = (__m512bh)_mm512_unpacklo_epi16(a, b), ab_hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
        for (int64_t g = 0; g < NG; ++g) {
          lo[g][j] = _mm512_dpbf16_ps(lo[g][j], p[g], ab_lo);
          hi[g][j] = _mm512_dpbf16_ps(hi[g][j], p[g], ab_hi);
        }
      }
    }
    if (fetch_next) prefetch_rows(t.kp, t.next_rows, std::min(t.n + t.n % 2, t.next_n), t.next_n, D * 2);
    // Lane q of lo holds dim 8 (q / 4) + q % 4 of its 32 (the unpack works within 128-bit lanes); of hi, 4 more.
    for (int64_t g = 0; g < NG; ++g) {
      for (int64_t j = 0; j < K; ++j) {
        alignas(64) float l[16], h[16];
        _mm512_store_ps(l, _mm512_mul_ps(lo[g][j], _mm512_set1_ps(inv[g])));
        _mm512_store_ps(h, _mm512_mul_ps(hi[g][j], _mm512_set1_ps(inv[g])));
        float* out = acc + g * D + d + 32 * j;
        for (int64_t q = 0; q < 16; ++q) {
          out[8 * (q / 4) + q % 4] = l[q];
          out[8 * (q / 4) + 4 + q % 4] = h[q];
        }
      }
    }
  }
}

// Sequence b's every KV head in one task (a bf16 cache on vdpbf16ps, G <= kHeadsPerPass, the heads' rows of a
// token side by side): the score loop reads each token's whole record (K of every head, contiguous) and
// prefetches whole V records ahead, so the hardware sees one sequential run per block instead of every
// head's task striding over the same lines; then each head's softmax and V sum (from L2) as heads_pass does,
// the V sums prefetching the next sequence's K rows. t.rows: head 0's rows; t.s: G * Hkv rows of L.
template <int64_t D, int64_t NG>
TOLLWAY_BF16_DOT void sequence_task(const DecodeGeometry& geo, const BFloat16* qp, BFloat16* op, int64_t b,
                                    float fscale, TaskRows<BFloat16> t) {
  const int64_t Hkv = geo.Hkv;
  scores_bf16<D, NG>(qp + geo.q_offset(b, 0), geo.qs1, t, Hkv, geo.cs2);
  const int64_t n_padded = (t.n + W - 1) / W * W;
  for (int64_t h = 0; h < Hkv; ++h) {
    TaskRows<BFloat16> head = t;  // head h's rows are head 0's shifted by its offset in the record
    head.kp += h * geo.cs2, head.vp += h * geo.cs2, head.s += h * NG * t.L;
    float inv[NG];
    for (int64_t g = 0; g < NG; ++g) inv[g] = softmax_in_place<true>(head.s + g * t.L, t.n, n_padded, fscale);
    alignas(64) float acc[NG * D];
    value_sum_bf16<D, NG>(head, inv, acc);
    for (int64_t g = 0; g < NG; ++g) store_floats(acc + g * D, op + geo.out_offset(b, h * NG + g), D);
  }
}

// The op by sequence_task where it applies (else false): a task per sequence where there are enough of them
// to share out over the threads; fewer (one stream, a few) keep a task per KV head (paged_decode.cpp).
// `batch_rows`: the rows to attend (those outside prefill runs); `dots`: bf16_decode_dots() for this call.
template <int64_t D>
bool decode_by_sequence(const DecodeGeometry& geo, const std::vector<int64_t>& batch_rows, const BFloat16* qp,
                        const BFloat16* kp, const BFloat16* vp, BFloat16* op, float fscale, int64_t window,
                        bool dots) {
  const int64_t Hkv = geo.Hkv, G = geo.G, L = geo.L, count = static_cast<int64_t>(batch_rows.size());
  if (!(dots && G <= kHeadsPerPass && geo.cs2 == D && count >= 2 * at::get_num_threads())) {
    return false;
  }
  LongestFirst tasks(count, [&](int64_t i) { return geo.lens[batch_rows[i]]; });
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(Hkv * G * L);
    ClaimedRows claimed(L);  // head 0's rows of this sequence and of the thread's next
    std::vector<BFloat16> probs16(G * L);
    auto sequence_rows = [&](int64_t task, int64_t* into) {
      const int64_t b = batch_rows[task], start = geo.start(b, window), n = geo.lens[b] - start;
      geo.fill_rows(b, 0, start, n, into);
      return n;
    };
    tasks.run_claimed([&](int64_t task, int64_t next) {
      const int64_t n = claimed.advance(task, next, sequence_rows), b = batch_rows[task];
      const TaskRows<BFloat16> t{kp, vp, claimed.rows.data(), n, scores.data(), L, true, claimed.next_rows.data(),
                                 claimed.next_n, probs16.data()};
      switch (G) {
        case 1: sequence_task<D, 1>(geo, qp, op, b, fscale, t); break;
        case 2: sequence_task<D, 2>(geo, qp, op, b, fscale, t); break;
        case 3: sequence_task<D, 3>(geo, qp, op, b, fscale, t); break;
        case 4: sequence_task<D, 4>(geo, qp, op, b, fscale, t); break;
      }
    });
  });
  return true;
}

}  // namespace tollway_native
#endif
