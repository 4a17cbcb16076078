// paged_decode over the int8 KV cache (kernels/kv_int8.py): rows of D codes and their fp32 scale.
#include "paged_decode.h"

#include <ATen/Parallel.h>

#include <vector>

namespace {

using namespace tollway_native;

// paged_decode over an int8 cache: the same tasks as above; a row's D codes are widened W at a time and
// its scale applied once per row (to the score after the dot product, to the probability before the V
// sum), so the K and V bytes read per token and head are D + 4 instead of 2D or 4D.
template <typename T, int64_t D>
void paged_decode_int8_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                            at::Tensor& out) {
  static_assert(D % W == 0, "whole vectors of codes per row");
  constexpr int64_t V = D / W;  // vectors per row
  const DecodeGeometry geo(q, k_cache, tables, lens, out);
  const int64_t Hkv = geo.Hkv, G = geo.G, L = geo.L;
  const T* qp = q.data_ptr<T>();
  const int8_t* kp = k_cache.data_ptr<int8_t>();
  const int8_t* vp = v_cache.data_ptr<int8_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, geo.B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L);
    std::vector<int64_t> rows(L);  // byte offset of each context token's row for this head
    std::vector<float> k_scales(L), v_scales(L);
    alignas(64) float qf[D];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t start = geo.start(b, window);
      const int64_t n = geo.lens[b] - start, n_padded = (n + W - 1) / W * W;
      geo.fill_rows(b, h, start, n, rows.data());
      for (int64_t i = 0; i < n; ++i) {
        k_scales[i] = row_scale(kp + rows[i], D);
        v_scales[i] = row_scale(vp + rows[i], D);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        load_floats(qp + geo.q_offset(b, h * G + g), qf, D);
        Vec qv[V];
        for (int64_t j = 0; j < V; ++j) qv[j] = Vec::loadu(qf + j * W);
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {  // four dot products, one reduction
          if (g == 0) prefetch_ahead(kp, vp, rows.data(), i, n, D + kScaleBytes);
          Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
          for (int64_t j = 0; j < V; ++j) {
            a0 = at::vec::fmadd(qv[j], load_codes(kp + rows[i] + j * W), a0);
            a1 = at::vec::fmadd(qv[j], load_codes(kp + rows[i + 1] + j * W), a1);
            a2 = at::vec::fmadd(qv[j], load_codes(kp + rows[i + 2] + j * W), a2);
            a3 = at::vec::fmadd(qv[j], load_codes(kp + rows[i + 3] + j * W), a3);
          }
          reduce4(a0, a1, a2, a3, s + i);
          for (int64_t t = i; t < i + 4; ++t) s[t] *= k_scales[t];
        }
        for (; i < n; ++i) {
          Vec a(0.f);
          for (int64_t j = 0; j < V; ++j) a = at::vec::fmadd(qv[j], load_codes(kp + rows[i] + j * W), a);
          s[i] = reduce_add(a) * k_scales[i];
        }
        const Vec inv(softmax_in_place(s, n, n_padded, fscale));
        Vec acc[V];
        for (int64_t j = 0; j < V; ++j) acc[j] = Vec(0.f);
        for (i = 0; i < n; ++i) {
          const Vec p(s[i] * v_scales[i]);
          for (int64_t j = 0; j < V; ++j) acc[j] = at::vec::fmadd(p, load_codes(vp + rows[i] + j * W), acc[j]);
        }
        alignas(64) float result[D];
        for (int64_t j = 0; j < V; ++j) (acc[j] * inv).store(result + j * W);
        store_floats(result, op + geo.out_offset(b, h * G + g), D);
      }
    }
  });
}

template <typename T>
void paged_decode_int8_dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& t,
                                    const at::Tensor& l, double scale, int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 16: return paged_decode_int8_impl<T, 16>(q, k, v, t, l, scale, window, out);
    case 32: return paged_decode_int8_impl<T, 32>(q, k, v, t, l, scale, window, out);
    case 64: return paged_decode_int8_impl<T, 64>(q, k, v, t, l, scale, window, out);
    case 128: return paged_decode_int8_impl<T, 128>(q, k, v, t, l, scale, window, out);
    case 256: return paged_decode_int8_impl<T, 256>(q, k, v, t, l, scale, window, out);
    default: TORCH_CHECK(false, "paged_decode: head_dim must be 16, 32, 64, 128 or 256, got ", q.size(2));
  }
}

}  // namespace

void tollway_native::paged_decode_int8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
                                       at::Tensor& out) {
  if (q.scalar_type() == at::kFloat) return paged_decode_int8_dispatch_dim<float>(q, k_cache, v_cache, tables, lens, scale, window, out);
  paged_decode_int8_dispatch_dim<BFloat16>(q, k_cache, v_cache, tables, lens, scale, window, out);
}
