// What every AMX kernel of the library shares: whether this process may use the tiles, and their configuration.
//
// The library is built for AVX512 alone (build.py): AMX functions carry TOLLWAY_AMX, compiled for that extension
// only, and run where amx_available() says so. The tile registers are per thread and other libraries (oneDNN,
// torch's SDPA) configure their own on every call: each task loads its configuration and releases the tiles.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace tollway_native {

#define TOLLWAY_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// The CPU has AMX-BF16 (and AVX512-BF16 beside it) and the kernel lets this process use the tile data
// (ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process; oneDNN asks the same).
inline bool amx_available() {
  static const bool available = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16") &&
           syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return available;
}

struct alignas(64) TileConfig {  // the LDTILECFG layout, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 with rows[t] rows of 64 bytes each (0: unused).
TOLLWAY_AMX inline void configure_tiles(const uint8_t (&rows)[8]) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = rows[t], cfg.colsb[t] = rows[t] ? 64 : 0;
  _tile_loadconfig(&cfg);
}

}  // namespace tollway_native
#endif
