// Prefill rows of paged_decode as tiles: where consecutive rows are one sequence's consecutive new tokens (a
// prefill chunk passed as decode rows, workers/models/fused_decode.py), each row reading the same blocks up to
// its own position, a tile of those tokens attends as two small GEMMs per KV head instead of a row at a time.
//
// A task takes up to kTileTokens tokens of a run and one KV head: its G query heads for each token are the
// tile's rows. It widens the context's K rows (the tile's last token's, which every row of the tile reads a
// prefix of) into a transposed buffer, K^T [D][n], so that the scores are a register-tiled GEMM: kMicroRows
// query rows x 2W keys of accumulators, each K^T vector loaded once for the micro-tile's rows and each q value
// broadcast (where the row kernel loads a K vector per query head and reduces each dot product across lanes).
// Each row's softmax covers its own length (its token's position + 1); the V sum is the same tiling over the
// row's probabilities (broadcast) and V's rows read in place (2W values of each per pass).
#pragma once

#include "paged_decode.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <vector>

namespace tollway_native {

constexpr int64_t kTileTokens = 16;  // a task's tokens (x G query heads: its rows)
constexpr int64_t kMicroRows = 6;    // rows per register tile: 6 x 2 accumulators + 2 loads + 1 broadcast <= 16
constexpr int64_t kMinRunRows = 8;   // shorter runs stay rows

// x rounded up to a multiple of `to`.
constexpr int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Rows [first, first + count) of the batch: one sequence's consecutive tokens.
struct PrefillRun {
  int64_t first, count;
};

// Row b + 1 continues row b's run: its length is one more, and it reads the same blocks as far as it reads.
inline bool continues_run(const DecodeGeometry& geo, int64_t b) {
  const int64_t len = geo.lens[b + 1];
  if (len != int64_t(geo.lens[b]) + 1) return false;
  const int32_t* mine = geo.tables + b * geo.ts0;
  const int32_t* next = geo.tables + (b + 1) * geo.ts0;
  for (int64_t block = 0; block < (len + geo.BS - 1) / geo.BS; ++block) {
    if (mine[block] != next[block]) return false;
  }
  return true;
}

// The batch's runs of at least kMinRunRows rows (none under a sliding window: its rows' starts differ); the other
// rows go to `singles`.
inline std::vector<PrefillRun> find_prefill_runs(const DecodeGeometry& geo, int64_t window,
                                                 std::vector<int64_t>& singles) {
  std::vector<PrefillRun> runs;
  for (int64_t b = 0; b < geo.B;) {
    int64_t end = b + 1;
    if (window <= 0) {
      while (end < geo.B && continues_run(geo, end - 1)) ++end;
    }
    if (end - b >= kMinRunRows) {
      runs.push_back({b, end - b});
    } else {
      for (int64_t row = b; row < end; ++row) singles.push_back(row);
    }
    b = end;
  }
  return runs;
}

// A thread's buffers, sized for the longest context: K^T, the scores, the rows' q and outputs, the row offsets.
struct TileScratch {
  std::vector<float> kt, s, q, out;
  std::vector<int64_t> rows;
  int64_t n_cap;  // keys per K^T / score row (the longest context rounded up to 2W)
  TileScratch(int64_t max_len, int64_t G, int64_t D)
      : n_cap(round_up(max_len, 2 * W)) {
    const int64_t m = round_up(kTileTokens * G, kMicroRows);
    kt.resize(D * n_cap);
    s.resize(m * n_cap);
    q.resize(m * D);
    out.resize(m * D);
    rows.resize(max_len);
  }
};

// Scores of micro-tile rows [r0, r0 + kMicroRows) against keys [0, keys) (keys a multiple of 2W), into s.
template <int64_t D>
inline void tile_scores(const float* q, const float* kt, int64_t n_cap, int64_t keys, float* s) {
  for (int64_t j = 0; j < keys; j += 2 * W) {
    Vec acc[kMicroRows][2];
    for (int64_t r = 0; r < kMicroRows; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec b0 = Vec::loadu(kt + d * n_cap + j), b1 = Vec::loadu(kt + d * n_cap + j + W);
#pragma GCC unroll 8
      for (int64_t r = 0; r < kMicroRows; ++r) {
        const Vec a(q[r * D + d]);
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    }
    for (int64_t r = 0; r < kMicroRows; ++r) {
      acc[r][0].store(s + r * n_cap + j);
      acc[r][1].store(s + r * n_cap + j + W);
    }
  }
}

// out[r] = sum_j p_r[j] v_j for the micro-tile's rows over keys [0, keys) (each row's p zero past its length).
template <typename C, int64_t D>
inline void tile_values(const float* p, int64_t n_cap, const C* vp, const int64_t* rows, int64_t keys, float* out) {
  for (int64_t d = 0; d < D; d += 2 * W) {
    Vec acc[kMicroRows][2];
    for (int64_t r = 0; r < kMicroRows; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
    for (int64_t j = 0; j < keys; ++j) {
      const C* row = vp + rows[j];
      const Vec v0 = load_row<C, D>(row, d), v1 = load_row<C, D>(row, d + W);
#pragma GCC unroll 8
      for (int64_t r = 0; r < kMicroRows; ++r) {
        const Vec a(p[r * n_cap + j]);
        acc[r][0] = at::vec::fmadd(a, v0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, v1, acc[r][1]);
      }
    }
    for (int64_t r = 0; r < kMicroRows; ++r) {
      acc[r][0].store(out + r * D + d);
      acc[r][1].store(out + r * D + d + W);
    }
  }
}

// Tokens [first, first + count) of a run (batch rows), KV head h: their G query heads each.
template <typename T, typename C, int64_t D>
void prefill_tile(const DecodeGeometry& geo, const T* qp, const C* kp, const C* vp, T* op, int64_t first,
                  int64_t count, int64_t h, float fscale, TileScratch& t) {
  const int64_t G = geo.G, n = geo.lens[first + count - 1], n_cap = t.n_cap;
  const int64_t m = count * G, m_pad = round_up(m, kMicroRows);
  geo.fill_rows(first + count - 1, h, 0, n, t.rows.data());
  // K^T: key j's D values down column j. Columns past n hold whatever they held: the scores computed from them
  // lie past every row's length, which the softmax overwrites (-inf, then 0) before the V sum reads them.
  alignas(64) float widened[D];
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t o = 0; o < D; o += W) load_row<C, D>(kp + t.rows[j], o).store(widened + o);
    for (int64_t d = 0; d < D; ++d) t.kt[d * n_cap + j] = widened[d];
  }
  // Row r = token r / G, query head h * G + r % G; rows past m are zeros whose results are dropped.
  for (int64_t r = 0; r < m; ++r) load_floats(qp + geo.q_offset(first + r / G, h * G + r % G), t.q.data() + r * D, D);
  std::fill(t.q.data() + m * D, t.q.data() + m_pad * D, 0.f);
  for (int64_t r0 = 0; r0 < m_pad; r0 += kMicroRows) {
    // The micro-tile reads keys up to its last real row's length (rows past m: the tile's last token's).
    const int64_t last_token = std::min(m - 1, r0 + kMicroRows - 1) / G;
    const int64_t keys = geo.lens[first + last_token];
    const int64_t keys_2w = round_up(keys, 2 * W);
    float* s = t.s.data() + r0 * n_cap;
    tile_scores<D>(t.q.data() + r0 * D, t.kt.data(), n_cap, keys_2w, s);
    float inv[kMicroRows];
    for (int64_t r = 0; r < kMicroRows; ++r) {
      const int64_t len = r0 + r < m ? int64_t(geo.lens[first + (r0 + r) / G]) : keys;
      const int64_t len_w = round_up(len, W);
      inv[r] = softmax_in_place(s + r * n_cap, len, len_w, fscale);
      std::fill(s + r * n_cap + len_w, s + r * n_cap + keys_2w, 0.f);
    }
    tile_values<C, D>(s, n_cap, vp, t.rows.data(), keys, t.out.data() + r0 * D);
    for (int64_t r = 0; r < kMicroRows && r0 + r < m; ++r) {
      float* o = t.out.data() + (r0 + r) * D;
      for (int64_t d = 0; d < D; d += W) (Vec::loadu(o + d) * Vec(inv[r])).store(o + d);
      store_floats(o, op + geo.out_offset(first + (r0 + r) / G, h * G + (r0 + r) % G), D);
    }
  }
}

// Every run's tiles (of up to `tokens` tokens) x KV heads, the costliest first (a tile's cost grows with its
// context), taken by the threads from a shared counter: tile(first, count, h, scratch) for each, with a
// Scratch(max_len, G, D) a thread.
template <typename Scratch, typename Tile>
void run_prefill_tiles(const DecodeGeometry& geo, const std::vector<PrefillRun>& runs, int64_t D, const Tile& tile,
                       int64_t tokens = kTileTokens) {
  struct Task {
    int64_t first, count, h, cost;
  };
  std::vector<Task> tasks;
  int64_t max_len = 1;
  for (const PrefillRun& run : runs) {
    for (int64_t t0 = 0; t0 < run.count; t0 += tokens) {
      const int64_t count = std::min(tokens, run.count - t0), len = geo.lens[run.first + t0 + count - 1];
      max_len = std::max(max_len, len);
      for (int64_t h = 0; h < geo.Hkv; ++h) tasks.push_back({run.first + t0, count, h, count * len});
    }
  }
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch(max_len, geo.G, D);
    for (int64_t i = next++; i < int64_t(tasks.size()); i = next++) {
      const Task& task = tasks[i];
      tile(task.first, task.count, task.h, scratch);
    }
  });
}

template <typename T, typename C, int64_t D>
void prefill_runs(const DecodeGeometry& geo, const std::vector<PrefillRun>& runs, const T* qp, const C* kp,
                  const C* vp, T* op, float fscale) {
  run_prefill_tiles<TileScratch>(geo, runs, D, [&](int64_t first, int64_t count, int64_t h, TileScratch& scratch) {
    prefill_tile<T, C, D>(geo, qp, kp, vp, op, first, count, h, fscale, scratch);
  });
}

}  // namespace tollway_native
