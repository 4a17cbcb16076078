// The decode step's small fused ops, torch.ops.tollway_cpu.add_rms_norm / rotary_store / silu_mul: each
// computes in fp32 and rounds where torch's eager ops of the Python path round (kernels/reference.py shapes).
// Their bf16 roundings run W lanes at a time (round_vec / store_vec), bit-equal to c10's scalar BFloat16: the
// scalar loops cost a bf16 decode step at batch 32 ~2 ms on a 2-core AVX512 host (rotary_store 55 -> 15 us a call).
#include "common.h"
#include "step_ops.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace tollway_native;

// ---- residual add + RMSNorm -----------------------------------------------------------------
// A row of H floats at r += the row of H values at x (fp32 or bf16).
inline void add_row(float* r, const float* x, int64_t H) {
  for (int64_t i = 0; i < H; ++i) r[i] += x[i];
}

inline void add_row(float* r, const BFloat16* x, int64_t H) {
  int64_t i = 0;
  for (; i + W <= H; i += W) (Vec::loadu(r + i) + load_vec(x + i)).store(r + i);
  for (; i < H; ++i) r[i] += static_cast<float>(x[i]);
}

// The same for row n of an [N, H] x whose data is at xp: fp32 where x_float, else bf16.
inline void add_row(float* r, const void* xp, bool x_float, int64_t n, int64_t H) {
  if (x_float) add_row(r, static_cast<const float*>(xp) + n * H, H);
  else add_row(r, static_cast<const BFloat16*>(xp) + n * H, H);
}

// residual [N, H] fp32 += x (any of fp32/bf16, optional); out = weight * rms_norm(residual) in the
// weight's dtype, the normalised row rounded to that dtype before the weight multiplies it (as
// `weight * F.rms_norm(h.float()).to(weight.dtype)` does).
template <typename T>
void add_rms_norm_impl(at::Tensor& residual, const std::optional<at::Tensor>& x, const at::Tensor& weight,
                       double eps, at::Tensor& out) {
  const int64_t N = residual.size(0), H = residual.size(1);
  float* rp = residual.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool has_x = x.has_value(), x_float = has_x && x->scalar_type() == at::kFloat;
  const void* xp = has_x ? x->data_ptr() : nullptr;
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(H);
    for (int64_t n = begin; n < end; ++n) {
      float* r = rp + n * H;
      if (has_x) add_row(r, xp, x_float, n, H);
      const float inv = inverse_rms(r, H, eps);
      int64_t i = 0;
      for (; i + W <= H; i += W) {  // the tail's roundings, W lanes at a time
        store_vec(round_vec<T>(load_vec(wp + i) * round_vec<T>(Vec::loadu(r + i) * Vec(inv))), op + n * H + i);
      }
      for (; i < H; ++i) tmp[i] = round_to<T>(static_cast<float>(wp[i]) * round_to<T>(r[i] * inv));
      store_floats(tmp.data() + (H / W) * W, op + n * H + (H / W) * W, H - (H / W) * W);
    }
  });
}

}  // namespace

void tollway_native::add_residual(at::Tensor& residual, const at::Tensor& x) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kFloat &&
                  x.sizes() == residual.sizes() && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "add_residual: a contiguous fp32 residual and an fp32/bf16 x of its shape expected");
  const int64_t N = residual.size(0), H = residual.size(1);
  float* rp = residual.data_ptr<float>();
  const bool x_float = x.scalar_type() == at::kFloat;
  const void* xp = x.data_ptr();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) add_row(rp + n * H, xp, x_float, n, H);
  });
}

void tollway_native::add_rms_norm_out(at::Tensor& residual, const std::optional<at::Tensor>& x,
                                      const at::Tensor& weight, double eps, at::Tensor& out) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "add_rms_norm: the residual must be a contiguous fp32 [N, H]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "add_rms_norm: weight must be [H]");
  if (x.has_value()) {
    TORCH_CHECK(x->sizes() == residual.sizes() && x->is_contiguous() &&
                    (x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16),
                "add_rms_norm: x must be a contiguous fp32/bf16 tensor shaped as the residual");
  }
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "add_rms_norm: fp32 or bf16 weight only");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == residual.sizes() && out.scalar_type() == weight.scalar_type(),
              "add_rms_norm: the output must be a contiguous [N, H] in the weight's dtype");
  if (weight.scalar_type() == at::kFloat) return add_rms_norm_impl<float>(residual, x, weight, eps, out);
  add_rms_norm_impl<BFloat16>(residual, x, weight, eps, out);
}

namespace {

at::Tensor add_rms_norm(at::Tensor residual, const std::optional<at::Tensor>& x, const at::Tensor& weight,
                        double eps) {
  at::Tensor out = at::empty(residual.sizes(), weight.options());
  tollway_native::add_rms_norm_out(residual, x, weight, eps, out);
  return out;
}

// ---- rotary + K/V store ---------------------------------------------------------------------
// qkv [N, (Hq + 2 Hkv) * D] (q heads, k heads, v heads): q and k rotated in place ("rotate half"),
// then k and v written at their flat slots of the caches (a negative slot is skipped). cos/sin
// [N, D] in qkv's dtype. Each product and the sum are rounded as torch's `x * cos + rot * sin` does.
// The caches hold C (T, or fp16/bf16 under fp32 T): k and v are rounded to it as they are written; an
// int8 cache (C = int8_t) takes each head's row quantized (quantize_row).
template <typename T, typename C>
void rotary_store_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& slots, int64_t hq, int64_t hkv, int64_t D) {
  const int64_t N = qkv.size(0), half = D / 2, row_stride = qkv.stride(0);
  const int64_t kv_row = hkv * D, cache_row = hkv * k_cache.size(3);
  T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      T* row = xp + n * row_stride;
      const T* c = cp + n * cos.stride(0);
      const T* s = sp + n * sin.stride(0);
      for (int64_t head = 0; head < hq + hkv; ++head) {
        T* x = row + head * D;
        int64_t i = 0;
        for (; half % W == 0 && i < half; i += W) {  // the loop below, W lanes at a time (the same roundings)
          const Vec x1 = load_vec(x + i), x2 = load_vec(x + i + half);
          const Vec a1 = round_vec<T>(x1 * load_vec(c + i)), b1 = round_vec<T>(x2.neg() * load_vec(s + i));
          const Vec a2 = round_vec<T>(x2 * load_vec(c + i + half)), b2 = round_vec<T>(x1 * load_vec(s + i + half));
          store_vec(a1 + b1, x + i);
          store_vec(a2 + b2, x + i + half);
        }
        for (; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          const float a1 = round_to<T>(x1 * static_cast<float>(c[i]));
          const float b1 = round_to<T>(-x2 * static_cast<float>(s[i]));
          const float a2 = round_to<T>(x2 * static_cast<float>(c[i + half]));
          const float b2 = round_to<T>(x1 * static_cast<float>(s[i + half]));
          x[i] = T(a1 + b1);
          x[i + half] = T(a2 + b2);
        }
      }
      if (slot[n] >= 0) {
        if constexpr (std::is_same_v<C, int8_t>) {
          for (int64_t head = 0; head < hkv; ++head) {
            quantize_row(row + (hq + head) * D, kc + slot[n] * cache_row + head * int8_row_bytes(D), D);
            quantize_row(row + (hq + hkv + head) * D, vc + slot[n] * cache_row + head * int8_row_bytes(D), D);
          }
        } else if constexpr (std::is_same_v<T, C>) {
          std::copy(row + hq * D, row + hq * D + kv_row, kc + slot[n] * kv_row);
          std::copy(row + hq * D + kv_row, row + hq * D + 2 * kv_row, vc + slot[n] * kv_row);
        } else {  // T is fp32 here (kv_pair_ok)
          store_floats(row + hq * D, kc + slot[n] * kv_row, kv_row);
          store_floats(row + hq * D + kv_row, vc + slot[n] * kv_row, kv_row);
        }
      }
    }
  });
}

}  // namespace

void tollway_native::rotary_store(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                                  at::Tensor v_cache, const at::Tensor& slots, int64_t num_q_heads,
                                  int64_t num_kv_heads) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "rotary_store: caches must be contiguous and alike");
  const int64_t D = k_cache.scalar_type() == at::kChar ? int8_head_dim(k_cache.size(3)) : k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * D &&
                  k_cache.size(2) == num_kv_heads && D % 2 == 0 &&
                  (k_cache.scalar_type() != at::kChar || (D % kGroup == 0 && int8_row_bytes(D) == k_cache.size(3))),
              "rotary_store: qkv must be [N, (Hq + 2 Hkv) * D] with contiguous rows (int8 caches: D + D / 8 each)");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.stride(1) == 1 && sin.sizes() == cos.sizes() &&
                  sin.stride(1) == 1 && cos.size(0) == qkv.size(0),
              "rotary_store: cos/sin must be [N, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == qkv.size(0),
              "rotary_store: slots must be int64 [N]");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && kv_pair_ok(qkv.scalar_type(), k_cache.scalar_type()),
              "rotary_store: qkv and cos/sin must share a dtype, the caches hold it (fp16/bf16 under fp32, or int8)");
  const at::ScalarType cache = k_cache.scalar_type();
  if (cache == at::kChar && qkv.scalar_type() == at::kFloat) {
    return rotary_store_impl<float, int8_t>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  if (cache == at::kChar) {
    return rotary_store_impl<BFloat16, int8_t>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  if (qkv.scalar_type() == at::kFloat && cache == at::kFloat) {
    return rotary_store_impl<float, float>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  if (qkv.scalar_type() == at::kFloat && cache == at::kHalf) {
    return rotary_store_impl<float, Half>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  if (qkv.scalar_type() == at::kFloat) {
    return rotary_store_impl<float, BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
  }
  rotary_store_impl<BFloat16, BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, D);
}

namespace {

// ---- SiLU(gate) * up ------------------------------------------------------------------------
// gate_up [N, 2I] (gate first) -> [N, I]; silu rounded to the dtype before the product, as eager. In bf16 the
// exponential is exp_u20 (relative error ~1e-6, far below bf16's 2^-9: a rounding may land one step away from
// eager's, rarely): Sleef's exp was most of the op, ~1 ms of a batch-32 step on a 2-core AVX512 host.
template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (I + kChunk - 1) / kChunk;
  at::parallel_for(0, N * chunks, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float g[kChunk], u[kChunk];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / chunks, lo = (task % chunks) * kChunk, m = std::min(kChunk, I - lo);
      const T* gate = gp + n * 2 * I + lo;
      const T* up = gate + I;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {  // straight from the rows: no staging, no rounding
        T* o = op + n * I + lo;
        for (; i + W <= m; i += W) {
          const Vec x = Vec::loadu(gate + i);
          (x / (Vec(1.f) + x.neg().exp()) * Vec::loadu(up + i)).store(o + i);
        }
        for (; i < m; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
        continue;
      }
      T* o = op + n * I + lo;
      for (; i + W <= m; i += W) {  // silu rounded to T, times up, rounded to T as it is stored
        const Vec x = load_vec(gate + i);
        store_vec(round_vec<T>(x / (Vec(1.f) + x.neg().exp_u20())) * load_vec(up + i), o + i);
      }
      const int64_t done = i;
      for (int64_t j = done; j < m; ++j) g[j] = static_cast<float>(gate[j]), u[j] = static_cast<float>(up[j]);
      for (; i < m; ++i) g[i] = round_to<T>(g[i] / (1.f + std::exp(-g[i]))) * u[i];
      store_floats(g + done, o + done, m - done);
    }
  });
}

}  // namespace

void tollway_native::silu_mul_out(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous [N, 2I]");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "silu_mul: fp32 or bf16 only");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == gate_up.size(0) &&
                  out.size(1) == gate_up.size(1) / 2 && out.scalar_type() == gate_up.scalar_type(),
              "silu_mul: the output must be a contiguous [N, I] in gate_up's dtype");
  if (gate_up.scalar_type() == at::kFloat) return silu_mul_impl<float>(gate_up, out);
  silu_mul_impl<BFloat16>(gate_up, out);
}

namespace {

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2, "silu_mul: gate_up must be a contiguous [N, 2I]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  tollway_native::silu_mul_out(gate_up, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slots, int num_q_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_store", &tollway_native::rotary_store);
  m.impl("silu_mul", &silu_mul);
}
