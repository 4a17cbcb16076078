// paged_prefill_bf16.h's tiles with their products on AMX (TDPBF16PS), where the CPU has AMX-BF16 (issue 21).
//
// Why: a prefill run's attention is compute-bound (each tile of 16 tokens x G query heads multiplies its whole
// context's K and V), and on the Intel Xeons we were lent vdpbf16ps issues at a quarter of an fp32 FMA's rate:
// a 1,024-token prefill step of 395-token prompts on a 2-core AMX Xeon spent as long in this attention (~0.14
// TFLOP/s) as in oneDNN's linears (ops/bench/RESULTS.md). A TDPBF16PS multiplies 16 x 32 by 32 x 16 bf16 at once.
//
// The same task as prefill_tile_bf16 (a run's up to 16 tokens x one KV head, G query heads each: the rows), with
// its two GEMMs as tiles of 16 rows:
//   scores: A = 16 rows' q, 32 dims (64 bytes) a tile, as they lie; B = K^T pairs (fill_key_pairs' ktp: pair p
//           of key j at ktp[p][j], 16 pairs x 16 keys a tile); 64 keys a pass in C tiles 0-3, stored to s;
//   V sum:  A = 16 rows' probabilities rounded to bf16 (p16, 32 keys a tile, as the vdpbf16ps tiles round them);
//           B = V's rows in key pairs (vpair: key pair i's dim d at vpair[i][d], both keys' values in one 32-bit
//           word), 16 pairs x 16 dims a tile; 64 dims a pass in C tiles 0-3, stored to out.
// Each row's softmax covers its own length as before. Products are exact and summed in fp32 in the tile unit's
// order: results differ from the vdpbf16ps tiles' by fp32 rounding before the output's bf16 rounding
// (tests/unit/kernels/test_native_prefill_rows.py). Tiles: 0-3 C, 4 A, 5-7 B, all 16 rows of 64 bytes.
#pragma once

#include "amx.h"
#include "paged_prefill_bf16.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
namespace tollway_native {

constexpr int64_t kAmxRows = 16;  // rows of an A tile: query rows (scores, V sum), key pairs of a B tile

// Whether a bf16 prefill run's tiles take AMX: where amx_available(), unless TOLLWAY_PREFILL_PRODUCTS=bf16 asks
// for the vdpbf16ps tiles (read per call, so that ops/bench/step_ab.py can compare both in one process).
inline bool amx_prefill_tiles() {
  if (!amx_available()) return false;
  const char* forced = std::getenv("TOLLWAY_PREFILL_PRODUCTS");
  return forced == nullptr || std::strcmp(forced, "bf16") != 0;
}

constexpr int64_t kAmxTaskTokens = 64;  // a task's tokens: K^T and V's pairs built once for 64 x G rows

// A thread's buffers, sized for the longest context (keys rounded up to 64, a score pass): K^T pairs, V's rows in
// key pairs, and one 16-row tile's q pairs, scores, bf16 probabilities and outputs.
struct TileScratchAmx {
  int64_t n_cap;                        // keys a row of ktp, s and p16
  std::vector<uint32_t> ktp, vpair, q;  // ktp [D / 2][n_cap]; vpair [n_cap / 2][D]; q [16][D / 2]
  std::vector<float> s, out;            // [16][n_cap]; [16][D]
  std::vector<BFloat16> p16;            // [16][n_cap]
  std::vector<int64_t> rows;
  TileScratchAmx(int64_t max_len, int64_t, int64_t D)
      : n_cap(round_up(max_len, 64)), ktp(D / 2 * n_cap), vpair(n_cap / 2 * D), q(kAmxRows * D / 2),
        s(kAmxRows * n_cap), out(kAmxRows * D), p16(kAmxRows * n_cap), rows(max_len) {}
};

// vpair of keys [0, n) (t.rows), zero pairs up to n rounded to 32: word d of pair i = (v_2i[d], v_2i+1[d]).
template <int64_t D>
TOLLWAY_AMX void fill_value_pairs(const BFloat16* vp, int64_t n, TileScratchAmx& t) {
  // 16-bit lanes of a (v_2i) and b (v_2i+1) interleaved: dims 0-15 of the 32 a vector, then 16-31.
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t i = 0; i < round_up(n, 32) / 2; ++i) {
    uint32_t* out = t.vpair.data() + i * D;
    const int64_t j = 2 * i;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = j < n ? _mm512_loadu_si512(vp + t.rows[j] + d) : _mm512_setzero_si512();
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(vp + t.rows[j + 1] + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// Scores of 16 rows (q: their pairs, D / 2 a row) against keys [0, keys), keys a multiple of 64, into s.
template <int64_t D>
TOLLWAY_AMX void amx_scores(const uint32_t* q, const uint32_t* ktp, int64_t n_cap, int64_t keys, float* s) {
  const int64_t b_stride = n_cap * 4, s_stride = n_cap * 4;
  for (int64_t j = 0; j < keys; j += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < D / 32; ++c) {  // dims [32 c, 32 c + 32): pairs [16 c, 16 c + 16)
      _tile_loadd(4, q + 16 * c, D * 2);
      const uint32_t* b = ktp + 16 * c * n_cap + j;
      _tile_loadd(5, b, b_stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 16, b_stride);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 32, b_stride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 48, b_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, s + j, s_stride);
    _tile_stored(1, s + j + 16, s_stride);
    _tile_stored(2, s + j + 32, s_stride);
    _tile_stored(3, s + j + 48, s_stride);
  }
}

// out[r] = sum_j p_r[j] v_j for 16 rows over keys [0, keys), keys a multiple of 32 (p16 zero past each row's
// length up to keys, vpair zero past the context).
template <int64_t D>
TOLLWAY_AMX void amx_values(const BFloat16* p16, int64_t n_cap, const uint32_t* vpair, int64_t keys, float* out) {
  static_assert(D % 64 == 0, "passes of 64 dims");
  for (int64_t d = 0; d < D; d += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < keys; j += 32) {
      _tile_loadd(4, p16 + j, n_cap * 2);
      const uint32_t* b = vpair + j / 2 * D + d;
      _tile_loadd(5, b, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 16, D * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 32, D * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 48, D * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, out + d, D * 4);
    _tile_stored(1, out + d + 16, D * 4);
    _tile_stored(2, out + d + 32, D * 4);
    _tile_stored(3, out + d + 48, D * 4);
  }
}

// A row's softmax over its first `len` scores (scaled by fscale), written as bf16 probabilities up to keys_32
// (zeros past len): max, then exp and sum in one pass, the fp32 scores read twice and never written. The
// probabilities are those softmax_in_place<true> computes (scaled scores minus their max, exp_u20), summed in
// fp32 before their rounding; returns 1 / the sum.
TOLLWAY_AMX inline float softmax_to_bf16(const float* s, int64_t len, int64_t keys_32, float fscale, BFloat16* p) {
  // The lanes of scores [j, j + 16) within the row's length.
  auto live_lanes = [len](int64_t j) {
    return j >= len ? __mmask16(0) : len - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - j)) - 1);
  };
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 live = live_lanes(j);
    top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, s + j));
  }
  const __m512 scale = _mm512_set1_ps(fscale), row_max = _mm512_set1_ps(_mm512_reduce_max_ps(top) * fscale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys_32; j += 16) {
    const __mmask16 live = live_lanes(j);
    const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + j), scale), row_max);
    const __m512 e = _mm512_maskz_mov_ps(live, __m512(Vec(x).exp_u20()));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// Tokens [first, first + count) of a run (batch rows), KV head h: their G query heads each (prefill_tile's
// layout: row r = token r / G, query head h * G + r % G), 16 rows a tile.
template <int64_t D>
TOLLWAY_AMX void prefill_tile_amx(const DecodeGeometry& geo, const BFloat16* qp, const BFloat16* kp,
                                  const BFloat16* vp, BFloat16* op, int64_t first, int64_t count, int64_t h,
                                  float fscale, TileScratchAmx& t) {
  const int64_t G = geo.G, n = geo.lens[first + count - 1], n_cap = t.n_cap, m = count * G;
  geo.fill_rows(first + count - 1, h, 0, n, t.rows.data());
  fill_key_pairs<D>(kp, n, t, 64);
  fill_value_pairs<D>(vp, n, t);
  float* s = t.s.data();
  BFloat16* p16 = t.p16.data();
  float* out = t.out.data();
  configure_tiles({16, 16, 16, 16, 16, 16, 16, 16});
  for (int64_t r0 = 0; r0 < m; r0 += kAmxRows) {
    const int64_t rows = std::min(kAmxRows, m - r0);  // rows past m: zero q, results dropped
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(t.q.data() + r * D / 2, qp + geo.q_offset(first + (r0 + r) / G, h * G + (r0 + r) % G),
                  D * sizeof(BFloat16));
    }
    std::fill(t.q.data() + rows * D / 2, t.q.data() + kAmxRows * D / 2, 0u);
    // The tile reads keys up to its last real row's length; rows past m take that length too.
    const int64_t keys = geo.lens[first + (r0 + rows - 1) / G];
    const int64_t keys_32 = round_up(keys, 32), keys_64 = round_up(keys, 64);
    amx_scores<D>(t.q.data(), t.ktp.data(), n_cap, keys_64, s);
    float inv[kAmxRows];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t len = geo.lens[first + (r0 + r) / G];
      inv[r] = softmax_to_bf16(s + r * n_cap, len, keys_32, fscale, p16 + r * n_cap);
    }
    for (int64_t r = rows; r < kAmxRows; ++r) std::fill(p16 + r * n_cap, p16 + r * n_cap + keys_32, BFloat16(0.f));
    amx_values<D>(p16, n_cap, t.vpair.data(), keys_32, out);
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + r * D;
      for (int64_t d = 0; d < D; d += W) (Vec::loadu(o + d) * Vec(inv[r])).store(o + d);
      store_floats(o, op + geo.out_offset(first + (r0 + r) / G, h * G + (r0 + r) % G), D);
    }
  }
  _tile_release();
}

template <int64_t D>
void prefill_runs_amx(const DecodeGeometry& geo, const std::vector<PrefillRun>& runs, const BFloat16* qp,
                      const BFloat16* kp, const BFloat16* vp, BFloat16* op, float fscale) {
  run_prefill_tiles<TileScratchAmx>(geo, runs, D,
                                    [&](int64_t first, int64_t count, int64_t h, TileScratchAmx& scratch) {
                                      prefill_tile_amx<D>(geo, qp, kp, vp, op, first, count, h, fscale, scratch);
                                    }, kAmxTaskTokens);
}

}  // namespace tollway_native
#endif
