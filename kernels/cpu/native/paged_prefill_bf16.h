// paged_prefill.h's tiles on AVX512-BF16's vdpbf16ps, for a bf16 model over a bf16 cache (issue 21).
//
// Why: under a bf16 q every prefill row went as a decode row (a task per sequence row, paged_decode_bf16.h),
// each re-reading its context and summing each score across lanes: a profile of 16 prompts of 395 tokens on a
// 2-core Zen 4 EPYC spent 0.54 of 3.92 s in that attention (~160 GFLOP/s) beside oneDNN's linears at the
// cores' rate (ops/bench/RESULTS.md). Here a run's tile is two small GEMMs per KV head, as the fp32 tiles:
//   scores: K^T as 32-bit pairs of D, ktp [D / 2][n_cap] (key j's pair p at ktp[p][j], 16 keys at once by a
//           16 x 16 transpose), against each row's q pairs broadcast: a vdpbf16ps multiplies 2 dims of 16 keys
//           for one row, kScoreRows rows x 32 keys of fp32 accumulators a micro-tile;
//   V sum:  the probabilities rounded to bf16 (as value_sum_bf16 rounds them, relative 2^-9), pairs of keys'
//           rows interleaved 16 bits at a time, each pair (p_j, p_j+1) of a row broadcast: kValueRows rows x 64
//           dims of accumulators a pass.
// The products are exact and summed in fp32 in another order than the row kernel's: results differ from it
// by fp32 rounding before the output's bf16 rounding (tests/unit/kernels/test_native_prefill_rows.py).
#pragma once

#include "paged_prefill.h"

#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
namespace tollway_native {

constexpr int64_t kScoreRows = 12;  // 12 rows x 2 vectors of 16 keys = 24 accumulators, 2 K loads, 1 broadcast
constexpr int64_t kValueRows = 6;   // 6 rows x 4 vectors (64 dims, lo and hi halves) = 24, 4 V vectors, 1 p

// A thread's buffers, sized for the longest context: K^T pairs, scores, bf16 probabilities, q pairs, outputs.
struct TileScratchBf16 {
  std::vector<uint32_t> ktp, q;
  std::vector<float> s, out;
  std::vector<BFloat16> p16;
  std::vector<int64_t> rows;
  int64_t n_cap;  // keys per row of ktp, s and p16 (the longest context rounded up to 32)
  TileScratchBf16(int64_t max_len, int64_t G, int64_t D) : n_cap(round_up(max_len, 32)) {
    const int64_t m = round_up(kTileTokens * G, kScoreRows);
    ktp.resize(D / 2 * n_cap);
    q.resize(m * D / 2);
    s.resize(m * n_cap);
    p16.resize(m * n_cap);
    out.resize(m * D);
    rows.resize(max_len);
  }
};

// K^T pairs of keys [0, n) (t.rows), zeros up to n rounded to `keys_multiple`: 16 keys' rows at a time,
// transposed 16 x 16 32-bit words per 32 dims.
template <int64_t D, typename Scratch>
TOLLWAY_BF16_DOT void fill_key_pairs(const BFloat16* kp, int64_t n, Scratch& t, int64_t keys_multiple = 32) {
  static_assert(D % 32 == 0, "whole vectors of 16 pairs");
  for (int64_t j0 = 0; j0 < round_up(n, keys_multiple); j0 += 16) {
    for (int64_t c = 0; c < D / 32; ++c) {  // pairs [16 c, 16 c + 16)
      __m512i r[16];
      for (int64_t u = 0; u < 16; ++u) {
        r[u] = j0 + u < n ? _mm512_loadu_si512(kp + t.rows[j0 + u] + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(t.ktp.data() + (16 * c + p) * t.n_cap + j0, r[p]);
    }
  }
}

// Scores of kScoreRows rows (q pairs from q, D / 2 a row) against keys [0, keys), keys a multiple of 32.
template <int64_t D>
TOLLWAY_BF16_DOT void tile_scores_bf16(const uint32_t* q, const uint32_t* ktp, int64_t n_cap, int64_t keys,
                                       float* s) {
  for (int64_t j = 0; j < keys; j += 32) {
    __m512 acc[kScoreRows][2];
    for (int64_t r = 0; r < kScoreRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(ktp + p * n_cap + j);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(ktp + p * n_cap + j + 16);
#pragma GCC unroll 12
      for (int64_t r = 0; r < kScoreRows; ++r) {
        const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[r * D / 2 + p]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, pair);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, pair);
      }
    }
    for (int64_t r = 0; r < kScoreRows; ++r) {
      _mm512_storeu_ps(s + r * n_cap + j, acc[r][0]);
      _mm512_storeu_ps(s + r * n_cap + j + 16, acc[r][1]);
    }
  }
}

// out[r] = sum_j p_r[j] v_j for kValueRows rows over keys [0, keys) (p16: bf16, zero past each row's length
// up to at least keys + 1): two keys a step, a lone last key beside a zero row.
template <int64_t D>
TOLLWAY_BF16_DOT void tile_values_bf16(const BFloat16* p16, int64_t n_cap, const BFloat16* vp, const int64_t* rows,
                                       int64_t keys, float* out) {
  constexpr int64_t KV = D % 64 == 0 ? 2 : 1;  // vectors of 32 dims a pass
  alignas(64) static const BFloat16 zeros[D] = {};
  for (int64_t d = 0; d < D; d += 32 * KV) {
    __m512 lo[kValueRows][KV], hi[kValueRows][KV];
    for (int64_t r = 0; r < kValueRows; ++r) {
      for (int64_t c = 0; c < KV; ++c) lo[r][c] = hi[r][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < keys; j += 2) {
      const BFloat16* r0 = vp + rows[j] + d;
      const BFloat16* r1 = j + 1 < keys ? vp + rows[j + 1] + d : zeros + d;
      __m512bh ab_lo[KV], ab_hi[KV];
      for (int64_t c = 0; c < KV; ++c) {
        const __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
        ab_lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        ab_hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
#pragma GCC unroll 6
      for (int64_t r = 0; r < kValueRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, p16 + r * n_cap + j, sizeof(pair));  // p_j in the low half, p_j+1 in the high
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
        for (int64_t c = 0; c < KV; ++c) {
          lo[r][c] = _mm512_dpbf16_ps(lo[r][c], p, ab_lo[c]);
          hi[r][c] = _mm512_dpbf16_ps(hi[r][c], p, ab_hi[c]);
        }
      }
    }
    // Lane q of lo holds dim 8 (q / 4) + q % 4 of its 32 (the unpack works within 128-bit lanes); of hi, 4 more.
    for (int64_t r = 0; r < kValueRows; ++r) {
      for (int64_t c = 0; c < KV; ++c) {
        alignas(64) float l[16], h[16];
        _mm512_store_ps(l, lo[r][c]);
        _mm512_store_ps(h, hi[r][c]);
        float* o = out + r * D + d + 32 * c;
        for (int64_t q = 0; q < 16; ++q) {
          o[8 * (q / 4) + q % 4] = l[q];
          o[8 * (q / 4) + 4 + q % 4] = h[q];
        }
      }
    }
  }
}

// Tokens [first, first + count) of a run (batch rows), KV head h: their G query heads each (prefill_tile's
// layout: row r = token r / G, query head h * G + r % G).
template <int64_t D>
TOLLWAY_BF16_DOT void prefill_tile_bf16(const DecodeGeometry& geo, const BFloat16* qp, const BFloat16* kp,
                                        const BFloat16* vp, BFloat16* op, int64_t first, int64_t count, int64_t h,
                                        float fscale, TileScratchBf16& t) {
  const int64_t G = geo.G, n = geo.lens[first + count - 1], n_cap = t.n_cap;
  const int64_t m = count * G, m_pad = round_up(m, kScoreRows);
  geo.fill_rows(first + count - 1, h, 0, n, t.rows.data());
  fill_key_pairs<D>(kp, n, t);
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(t.q.data() + r * D / 2, qp + geo.q_offset(first + r / G, h * G + r % G), D * sizeof(BFloat16));
  }
  std::fill(t.q.data() + m * D / 2, t.q.data() + m_pad * D / 2, 0u);
  // The length of row r (rows past m: `keys`, the micro-tile's).
  auto row_length = [&](int64_t r, int64_t keys) { return r < m ? int64_t(geo.lens[first + r / G]) : keys; };
  for (int64_t r0 = 0; r0 < m_pad; r0 += kScoreRows) {
    const int64_t keys = geo.lens[first + std::min(m - 1, r0 + kScoreRows - 1) / G];
    const int64_t keys_32 = round_up(keys, 32);
    float* s = t.s.data() + r0 * n_cap;
    BFloat16* p16 = t.p16.data() + r0 * n_cap;
    tile_scores_bf16<D>(t.q.data() + r0 * D / 2, t.ktp.data(), n_cap, keys_32, s);
    float inv[kScoreRows];
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const int64_t len = row_length(r0 + r, keys), len_w = round_up(len, W);
      float* row = s + r * n_cap;
      inv[r] = softmax_in_place<true>(row, len, len_w, fscale);
      std::fill(row + len_w, row + keys_32, 0.f);
      for (int64_t j = 0; j < keys_32; j += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + r * n_cap + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + j)));
      }
    }
    for (int64_t v0 = 0; v0 < kScoreRows; v0 += kValueRows) {
      const int64_t value_keys = row_length(std::min(m - 1, r0 + v0 + kValueRows - 1), keys);
      float* out = t.out.data() + (r0 + v0) * D;
      tile_values_bf16<D>(p16 + v0 * n_cap, n_cap, vp, t.rows.data(), value_keys, out);
      for (int64_t r = v0; r < v0 + kValueRows && r0 + r < m; ++r) {
        float* o = t.out.data() + (r0 + r) * D;
        for (int64_t d = 0; d < D; d += W) (Vec::loadu(o + d) * Vec(inv[r])).store(o + d);
        store_floats(o, op + geo.out_offset(first + (r0 + r) / G, h * G + (r0 + r) % G), D);
      }
    }
  }
}

template <int64_t D>
void prefill_runs_bf16(const DecodeGeometry& geo, const std::vector<PrefillRun>& runs, const BFloat16* qp,
                       const BFloat16* kp, const BFloat16* vp, BFloat16* op, float fscale) {
  run_prefill_tiles<TileScratchBf16>(geo, runs, D,
                                     [&](int64_t first, int64_t count, int64_t h, TileScratchBf16& scratch) {
                                       prefill_tile_bf16<D>(geo, qp, kp, vp, op, first, count, h, fscale, scratch);
                                     });
}

}  // namespace tollway_native
#endif
