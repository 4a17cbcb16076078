// tollway's native CPU ops for the decode step, registered as torch.ops.tollway_cpu.*.
//
// Built by kernels/cpu/native/build.py with AVX2 or AVX512 flags (CPU_CAPABILITY_* selects ATen's
// Vectorized<float> width W = 8 or 16). Shapes follow kernels/reference.py:
//   K/V cache per layer [num_blocks, block_size, Hkv, D] (rows of one token contiguous: stride(3) == 1);
//   an int8 cache's rows are D codes and an fp16 scale per 16 of them, [.., D + D / 8] (kernels/kv_int8.py);
//   block_tables [B, max_blocks] int32, context_lens [B] int32 (tokens held, the new one included).
// Every op computes in fp32 and rounds to the tensor dtype (fp32 or bf16) where torch's eager ops
// of the Python path round, so fp32 results match that path to the last bits or nearly.
//
// The ops live in paged_decode.cpp, layer_ops.cpp, layer_stack.cpp, head_ops.cpp, quantized_matmul.cpp,
// quantized_q8.cpp, quantized_vnni.cpp and quantized_avx2.cpp, each registering its own as a fragment of the library this file defines.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <mutex>
#include <set>
#include <thread>

// How many threads an at::parallel_for over `n` items runs on here: the library's ops split their
// work this way, and a build without OpenMP would run each on one thread (tests check it).
int64_t parallel_threads(int64_t n) {
  std::mutex lock;
  std::set<std::thread::id> seen;
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    volatile double sink = 0;  // a little work, so one thread does not take every item before the others start
    for (int i = 0; i < 200000; ++i) sink = sink + i;
    std::lock_guard<std::mutex> hold(lock);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(seen.size());
}

TORCH_LIBRARY(tollway_cpu, m) {
  m.def("parallel_threads(int n) -> int", &parallel_threads);
}
