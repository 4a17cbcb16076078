// What paged_decode.cpp's kernel (fp32/bf16/fp16 and int8 caches) is built from: the argument geometry,
// the prefetch, the softmax over a row of scores and the four-way reduction.
#pragma once

#include "common.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace tollway_native {

constexpr int64_t kMaxGroup = 8;   // query heads per KV head the kernels take
constexpr int64_t kPrefetch = 16;  // tokens ahead whose K/V rows are prefetched

// Query heads of one KV head that share a pass over its rows, and the vector registers the loops may fill.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kHeadsPerPass = 4, kRegisters = 32;
#else
constexpr int64_t kHeadsPerPass = 1, kRegisters = 16;
#endif

#if defined(CPU_CAPABILITY_AVX512)
// The CPU's family where it is an AMD one (Zen 4 is family 25, Zen 5 26), else 0.
inline unsigned amd_family() {
#if defined(__x86_64__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 0;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4), std::memcpy(vendor + 4, &edx, 4), std::memcpy(vendor + 8, &ecx, 4);
  if (std::strcmp(vendor, "AuthenticAMD") != 0 || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  const unsigned base = (eax >> 8) & 0xf;
  return base == 0xf ? base + ((eax >> 20) & 0xff) : base;
#else
  return 0;
#endif
}

// Whether a bf16 q over a bf16 cache takes the decode rows' products on vdpbf16ps (paged_decode_bf16.h: the
// scores two dims a lane, the V sum two tokens a lane with the probabilities rounded to bf16, a task per sequence)
// rather than widening each row to fp32 (scores_float and value_sum, a task per KV head, as an fp32 q does).
// vdpbf16ps halves the op's compute with its cache hot, but in the step the op waits on its K/V. Per-step A/Bs in
// random order (ops/bench/step_ab.py, ops/bench/RESULTS.md) chose per CPU: on a Zen 5 the fp32 products' step at
// batch 32 x 380 was 0.9-1.3 ms shorter, on an Emerald Rapids Xeon (where vdpbf16ps issues at a quarter of an
// FMA's rate) 0.7-1.4 ms shorter, on a Zen 4 1.0-2.0 ms longer. So vdpbf16ps is taken on AMD family 25 only.
// TOLLWAY_DECODE_DOTS=bf16 or fp32 overrides the choice. paged_decode reads it once per call (~30 a step), so
// ops/bench/step_ab.py can compare both in one process; the CPU's own choice is taken once, as CPUID in a guest
// exits to the hypervisor (a throw-away build that asked it per pass made the bf16 step 2.7x slower).
inline bool bf16_decode_dots() {
  if (!bf16_dot_available()) return false;
  static const bool cpu_choice = amd_family() == 25;
  const char* forced = std::getenv("TOLLWAY_DECODE_DOTS");
  if (forced != nullptr && std::strcmp(forced, "bf16") == 0) return true;
  if (forced != nullptr && std::strcmp(forced, "fp32") == 0) return false;
  return cpu_choice;
}
#endif

// Vectors of a V row summed per pass over the tokens for NG heads: NG accumulators per vector, NG
// probabilities and the row's vector must fit the registers (one pass for D <= 8W with few heads).
template <int64_t V, int64_t NG>
constexpr int64_t value_chunk() {
  int64_t k = V;
  while (k > 1 && NG * k + NG + 1 > kRegisters) k /= 2;
  return k;
}

// One (sequence, KV head) task's view of its rows: the context's n row offsets into the caches, and the
// scores buffer (a row of L floats per query head of the pass). A sequence task (paged_decode_bf16.h) holds
// head 0's rows and shifts kp / vp by each head's offset in the token's record.
template <typename C>
struct TaskRows {
  const C* kp;
  const C* vp;
  const int64_t* rows;
  int64_t n;
  float* s;
  int64_t L;
  bool prefetch;  // the task's first pass: fetch the K and V rows kPrefetch tokens ahead
  const int64_t* next_rows;  // the thread's next task's row offsets (its K or V rows are fetched in this V sum)
  int64_t next_n;            // how many (0: no next task, or not this pass)
  BFloat16* probs16;  // bf16 caches: the pass's probabilities rounded to bf16, a row of L per head (value_sum_bf16)
  bool next_v = false;       // value_sum fetches the next task's V rows, not its K rows
};

// Bytes of a cache row of D values of C: int8 rows carry their groups' scales after the codes.
template <typename C, int64_t D>
constexpr int64_t row_bytes() {
  return std::is_same_v<C, int8_t> ? int8_row_bytes(D) : D * int64_t(sizeof(C));
}

// Prefetch the K and V rows (row_bytes each) of the four tokens kPrefetch after token i, where they exist:
// a sequence's blocks lie anywhere in the cache, so the hardware prefetcher loses the stream at every block
// boundary. The kernels call it from their first query head's score loop. Into L2 (locality 2): software
// prefetches into L1 wait for its few miss buffers, which capped the op's bandwidth (paged_decode.cpp).
template <typename C>
inline void prefetch_ahead(const C* kp, const C* vp, const int64_t* rows, int64_t i, int64_t n, int64_t row_bytes) {
  for (int64_t t = i + kPrefetch; t < std::min(i + kPrefetch + 4, n); ++t) {
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kp + rows[t]) + byte, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(vp + rows[t]) + byte, 0, 2);
    }
  }
}

// Prefetch the K rows (row_bytes each) of the next task's tokens [from, to) into L2. The V sum reads only
// rows the score loop already fetched, so without this the memory bus idles through it while the score loop
// waits on K and V both; the V sum calls this, spreading the next task's K rows over its tokens.
template <typename C>
inline void prefetch_rows(const C* kp, const int64_t* rows, int64_t from, int64_t to, int64_t row_bytes) {
  for (int64_t t = from; t < to; ++t) {
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kp + rows[t]) + byte, 0, 2);
    }
  }
}

// Scores s[0, n) scaled by fscale, then softmaxed in place over n_padded lanes (the padding set to
// exp(-inf) = 0); returns 1 / (sum of the exponentials), which the V sum multiplies by.
// Fast: exp_u20 (ATen's polynomial exp, relative error ~1e-6) for Sleef's exp_u10, for a bf16 output whose
// rounding (2^-9) dwarfs it: the exponentials cost ~a tenth of the op's compute at batch 32.
template <bool Fast = false>
inline float softmax_in_place(float* s, int64_t n, int64_t n_padded, float fscale) {
  Vec m(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= n; i += W) (Vec::loadu(s + i) * Vec(fscale)).store(s + i);
  for (; i < n; ++i) s[i] *= fscale;
  std::fill(s + n, s + n_padded, -std::numeric_limits<float>::infinity());
  for (i = 0; i < n_padded; i += W) m = at::vec::maximum(m, Vec::loadu(s + i));
  const Vec row_max(at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, m));
  Vec sum(0.f);
  for (i = 0; i < n_padded; i += W) {
    const Vec x = Vec::loadu(s + i) - row_max;
    const Vec p = Fast ? x.exp_u20() : x.exp();
    p.store(s + i);
    sum = sum + p;
  }
  return 1.f / reduce_add(sum);
}

// What both paged_decode kernels read of their arguments: shapes, strides, the tables and lengths, and
// L, the longest context rounded up to whole vectors (the scores' row length per query head).
struct DecodeGeometry {
  int64_t B, Hkv, BS, G, qs0, qs1, os0, os1, cs0, cs1, cs2, ts0, L;
  const int32_t* tables;
  const int32_t* lens;

  DecodeGeometry(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& tables_, const at::Tensor& lens_,
                 const at::Tensor& out)
      : B(q.size(0)), Hkv(k_cache.size(2)), BS(k_cache.size(1)), G(q.size(1) / k_cache.size(2)), qs0(q.stride(0)),
        qs1(q.stride(1)), os0(out.stride(0)), os1(out.stride(1)), cs0(k_cache.stride(0)), cs1(k_cache.stride(1)),
        cs2(k_cache.stride(2)), ts0(tables_.stride(0)), tables(tables_.data_ptr<int32_t>()),
        lens(lens_.data_ptr<int32_t>()) {
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
    L = (max_len + W - 1) / W * W;
  }
  // The first token sequence b attends to (where its window starts; 0 without one).
  int64_t start(int64_t b, int64_t window) const { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; }
  // rows[i] = the offset, in cache elements, of token start + i's row for KV head h of sequence b, for
  // i < n; a block at a time (no division per token).
  void fill_rows(int64_t b, int64_t h, int64_t start, int64_t n, int64_t* rows) const {
    for (int64_t t = start, i = 0; i < n;) {
      const int64_t base = int64_t(tables[b * ts0 + t / BS]) * cs0 + h * cs2;
      for (int64_t offset = t % BS; offset < BS && i < n; ++offset, ++t, ++i) rows[i] = base + offset * cs1;
    }
  }
  int64_t q_offset(int64_t b, int64_t head) const { return b * qs0 + head * qs1; }
  int64_t out_offset(int64_t b, int64_t head) const { return b * os0 + head * os1; }
};

// Decode tasks in the order threads claim them: the longest context first, each thread claiming its next
// task before it starts the current one, so the current one's passes can prefetch the next one's rows. It
// replaced a static split of the tasks in equal counts, which left a thread waiting on the other at every
// layer where its share held the longer contexts: 30 layers of a 2-core Zen 4's bf16 batch of 32, 16
// sequences of 700 tokens then 16 of 100, took 19.0 ms that way and 13.6 this way; equal contexts level.
class LongestFirst {
 public:
  // Tasks 0 .. count - 1, task i attending length(i) tokens, claimed `unit` at a time (unit consecutive tasks
  // of equal length stay together: a sequence's KV heads on one thread, reading its blocks' neighbouring rows).
  template <typename Length>
  LongestFirst(int64_t count, Length length, int64_t unit = 1) : order_(count), unit_(unit) {
    for (int64_t i = 0; i < count; ++i) order_[i] = i;
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return length(a) > length(b); });
  }
  // Calls work(task, next) for each task this thread claims; next is the task it runs after (-1: none).
  template <typename Work>
  void run_claimed(Work work) {
    const int64_t size = static_cast<int64_t>(order_.size());
    int64_t i = next_.fetch_add(unit_), end = std::min(i + unit_, size);
    while (i < end) {
      int64_t j = i + 1;
      if (j == end) {  // this unit's last task: the next unit is claimed first
        j = next_.fetch_add(unit_);
        end = std::min(j + unit_, size);
      }
      work(order_[i], j < end ? order_[j] : -1);
      i = j;
    }
  }

 private:
  std::vector<int64_t> order_;
  const int64_t unit_;
  std::atomic<int64_t> next_{0};
};

// A thread's rows for the task it runs and for the task it claimed next (LongestFirst::run_claimed): the next
// task's rows are filled before the current one runs, so its passes can prefetch them, then swapped in.
struct ClaimedRows {
  std::vector<int64_t> rows, next_rows;
  int64_t next_n = 0, fetched = -1;  // next_rows holds task `fetched`'s next_n rows

  explicit ClaimedRows(int64_t L) : rows(L), next_rows(L) {}

  // Before running `task` (followed by `next`; -1: none): rows gets task's rows, next_rows next's.
  // fill(task, into) writes a task's rows and returns their count. Returns task's count.
  template <typename Fill>
  int64_t advance(int64_t task, int64_t next, Fill fill) {
    const int64_t n = fetched == task ? next_n : fill(task, next_rows.data());
    rows.swap(next_rows);
    next_n = next >= 0 ? fill(next, next_rows.data()) : 0;
    fetched = next;
    return n;
  }
};

}  // namespace tollway_native
