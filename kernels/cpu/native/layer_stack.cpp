// torch.ops.tollway_cpu.decode_planned (with register_layer_plan / release_layer_plan): the whole decoder stack
// of a step whose tokens all attend as decode rows (token i over block_tables[i] up to context_lens[i]), in one
// call; `decode_layers` below does it from a plan's lists.
//
// The same ops, in the same order and with the same arguments, as the Python loop of
// workers/models/fused_decode.py (`_layers` with paged_decode attention): per layer the four projections,
// rotary_store, paged_decode, two add_rms_norm and silu_mul. Called one by one from Python, those ~270 ops
// cost microseconds each of argument parsing and glue; here they are C++ calls (one int4 stream on 2 cores
// decoded 25% faster, ops/bench/RESULTS.md). Our ops and few_rows_linear's projections are called straight
// (step_ops.h), each writing into one buffer per role that every layer reuses; until 2026-11-28 they went
// through torch's dispatcher, each allocating its output (~270 a step: a bf16 batch-32 step on a 2-core Zen 4
// ran ~0.3 ms slower that way, per-step alternations). The projections of other kinds still go boxed through
// the dispatcher (`project`).
//
// The plan (built once per model in workers/models/layer_plan.py) is flat lists with a fixed stride per
// layer, so no Python object crosses per layer:
//   tensors: kTensorsPerLayer per layer: input norm weight, post-attention norm weight, then kProjTensors
//            slots per projection (qkv, o, gate_up, down) in the order its kind takes them (unused: None);
//   ints:    kIntsPerLayer per layer: the sliding window (0: none), then per projection its kind and two ints;
//   floats:  kFloatsPerLayer per layer: the attention scale, the input norm's eps, the post-attention norm's eps.
// A projection's kind (ProjectionKind below) says which op runs it. Both sides must agree on these layouts:
// tests/unit/workers/test_layer_plan.py compares this op's step with the Python loop's for every kind.
#include "amx.h"
#include "step_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t kProjections = 4, kProjTensors = 3, kProjInts = 3;
constexpr int64_t kTensorsPerLayer = 2 + kProjections * kProjTensors;
constexpr int64_t kIntsPerLayer = 1 + kProjections * kProjInts;
constexpr int64_t kFloatsPerLayer = 3;

// How a projection runs (x first, then its tensors T0..T2 and ints I0, I1):
enum ProjectionKind : int64_t {
  kLinear = 0,   // aten::linear(x, weight T0, bias T1?)
  kMkldnn = 1,   // mkldnn::_linear_pointwise(x, packed T0, bias T1?, "none", [], ""): oneDNN's prepacked bf16
  kFewRows = 2,  // tollway_cpu::few_rows_linear(x, weight T0, bias T1?): fp32 or bf16 rows (few_rows*.cpp)
  kInt4 = 3,     // tollway_cpu::int4_matmul(x, qweight T0, scales T1, mins T2, n I0, group I1)
  kInt4Q8 = 4,   // tollway_cpu::int4_matmul_q8(the same, "auto")
  kInt8 = 5,     // tollway_cpu::int8_matmul(x, qweight T0, scales T1, n I0)
  kInt8Q8 = 6,   // tollway_cpu::int8_matmul_q8(the same, "auto")
  kAmxRows = 7,  // tollway_cpu::amx_rows_linear(x, packed T0, bias T1?): bf16 rows on AMX tiles (few_rows_amx.cpp)
};

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// oneDNN's packed bf16 GEMM (its AMX kernel) ran a 1,024-row prefill step's projections of 576 outputs (o_proj,
// down_proj) on two cores no faster than on one (a 2-core AMX Xeon: 0.59 / 1.72 ms on two threads, 0.54-0.61 /
// 1.58-1.84 on one), the second thread idle in libgomp for 18% of the step. On a CPU with AMX, from kSplitRowsMin
// rows, those two take each thread's share of x's rows, oneDNN single-threaded inside the region, and the parts
// joined: the engine's prefill 1.09-1.13x in three alternations. Splitting all four projections gained less (the
// wider ones already ran 1.4-1.5x on two threads, and their joins copy more). Not measured on other CPUs, so not
// taken there (ops/bench/RESULTS.md, "Issue 21 on host N").
constexpr int64_t kSplitRowsMin = 256;

bool amx_cpu() {
#if defined(CPU_CAPABILITY_AVX512)
  return tollway_native::amx_available();
#else
  return false;
#endif
}

// Whether a projection of x's rows goes by row blocks across the threads (rows_split).
bool splits_rows(const at::Tensor& x) {
  return x.size(0) >= kSplitRowsMin && at::get_num_threads() > 1 && !at::in_parallel_region() && amx_cpu();
}

// stack[1:] the op's arguments after x, stack[0] free: the op's result for x, by row blocks across the threads.
at::Tensor rows_split(const at::Tensor& x, const torch::jit::Stack& stack, const c10::OperatorHandle& handle) {
  const int64_t M = x.size(0), threads = at::get_num_threads();
  const int64_t chunk = (M + threads - 1) / threads;
  std::vector<at::Tensor> parts(threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t lo = t * chunk, hi = std::min(M, lo + chunk);
      if (lo >= hi) continue;
      torch::jit::Stack call = stack;
      call[0] = x.slice(0, lo, hi);
      handle.callBoxed(call);
      parts[t] = call[0].toTensor();
    }
  });
  std::vector<at::Tensor> done;
  for (at::Tensor& part : parts) {
    if (part.defined()) done.push_back(std::move(part));
  }
  return at::cat(done, 0);
}

// One projection of `x`, boxed: every kind's op takes x first. Each op is looked up on its kind's first use
// (a torch without MKL or oneDNN still runs the other kinds).
at::Tensor project(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors, int64_t t0,
                   c10::IntArrayRef ints, int64_t i0, bool split_rows = false) {
  auto tensor = [&](int64_t k) -> c10::IValue {
    const std::optional<at::Tensor> value = tensors.get(t0 + k);
    return value.has_value() ? c10::IValue(*value) : c10::IValue();
  };
  const int64_t kind = ints[i0], a = ints[i0 + 1], b = ints[i0 + 2];
  torch::jit::Stack stack{c10::IValue(), tensor(0)};  // x goes in stack[0] below
  const c10::OperatorHandle* handle = nullptr;
  switch (kind) {
    case kLinear: {
      static const c10::OperatorHandle linear = op("aten::linear");
      stack.push_back(tensor(1));
      handle = &linear;
      break;
    }
    case kFewRows: case kAmxRows: {
      static const c10::OperatorHandle few_rows = op("tollway_cpu::few_rows_linear");
      static const c10::OperatorHandle amx_rows = op("tollway_cpu::amx_rows_linear");
      stack.push_back(tensor(1));
      handle = kind == kFewRows ? &few_rows : &amx_rows;
      break;
    }
    case kMkldnn: {
      static const c10::OperatorHandle mkldnn = op("mkldnn::_linear_pointwise");
      stack.insert(stack.end(), {tensor(1), c10::IValue("none"), c10::IValue(c10::List<std::optional<at::Scalar>>()),
                                 c10::IValue("")});
      handle = &mkldnn;
      break;
    }
    case kInt4: case kInt4Q8: {
      static const c10::OperatorHandle int4 = op("tollway_cpu::int4_matmul");
      static const c10::OperatorHandle int4_q8 = op("tollway_cpu::int4_matmul_q8");
      stack.insert(stack.end(), {tensor(1), tensor(2), c10::IValue(a), c10::IValue(b)});
      if (kind == kInt4Q8) stack.emplace_back("auto");
      handle = kind == kInt4 ? &int4 : &int4_q8;
      break;
    }
    case kInt8: case kInt8Q8: {
      static const c10::OperatorHandle int8 = op("tollway_cpu::int8_matmul");
      static const c10::OperatorHandle int8_q8 = op("tollway_cpu::int8_matmul_q8");
      stack.insert(stack.end(), {tensor(1), c10::IValue(a)});
      if (kind == kInt8Q8) stack.emplace_back("auto");
      handle = kind == kInt8 ? &int8 : &int8_q8;
      break;
    }
    default: TORCH_CHECK(false, "decode_layers: unknown projection kind ", kind);
  }
  if (kind == kMkldnn && split_rows && splits_rows(x)) return rows_split(x, stack, *handle);
  stack[0] = x;
  handle->callBoxed(stack);
  return stack[0].toTensor();
}

// The step's intermediates, one buffer per role, allocated on first use and reused by every layer (an op's
// output is read by the next op only, before the same role is written again).
enum Role { kNormed, kQkv, kAttn, kO, kGateUp, kAct, kDown, kRoles };

struct Scratch {
  std::array<at::Tensor, kRoles> buffers;

  at::Tensor& get(Role role, at::IntArrayRef sizes, const at::TensorOptions& options) {
    at::Tensor& buffer = buffers[role];
    if (!buffer.defined() || buffer.sizes() != sizes || buffer.scalar_type() != options.dtype().toScalarType()) {
      buffer = at::empty(sizes, options);
    }
    return buffer;
  }
};

// A projection into its role's buffer where it runs on few_rows_linear (called straight); any other kind
// through the dispatcher (`project`), into a fresh tensor.
at::Tensor project_into(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors, int64_t t0,
                        c10::IntArrayRef ints, int64_t i0, Scratch& scratch, Role role) {
  if (ints[i0] != kFewRows) return project(x, tensors, t0, ints, i0, role == kO || role == kDown);
  const at::Tensor weight = tensors.get(t0).value();
  at::Tensor& y = scratch.get(role, {x.size(0), weight.size(0)}, x.options());
  tollway_native::few_rows_linear_out(x, weight, tensors.get(t0 + 1), y);
  return y;
}

void decode_layers(at::Tensor residual, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, at::TensorList k_caches,
                   at::TensorList v_caches, const c10::List<std::optional<at::Tensor>>& tensors,
                   c10::IntArrayRef ints, c10::ArrayRef<double> floats, int64_t num_q_heads, int64_t num_kv_heads,
                   int64_t head_dim) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(tensors.size()) == layers * kTensorsPerLayer &&
                  static_cast<int64_t>(ints.size()) == layers * kIntsPerLayer &&
                  static_cast<int64_t>(floats.size()) == layers * kFloatsPerLayer,
              "decode_layers: the plan's lists do not match the layer count");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "decode_layers: the residual must be a contiguous fp32 [N, H]");
  using namespace tollway_native;
  const int64_t n = residual.size(0), q_size = num_q_heads * head_dim;
  auto norm_weight = [&](int64_t layer, int64_t which) { return tensors.get(layer * kTensorsPerLayer + which).value(); };
  Scratch scratch;
  const at::Tensor first_norm = norm_weight(0, 0);
  at::Tensor normed = scratch.get(kNormed, residual.sizes(), first_norm.options());
  add_rms_norm_out(residual, std::nullopt, first_norm, floats[1], normed);
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t t = i * kTensorsPerLayer + 2, k = i * kIntsPerLayer + 1, f = i * kFloatsPerLayer;
    at::Tensor qkv = project_into(normed, tensors, t, ints, k, scratch, kQkv);
    rotary_store(qkv, cos, sin, k_caches[i], v_caches[i], slot_mapping, num_q_heads, num_kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_q_heads, head_dim});
    at::Tensor& attn = scratch.get(kAttn, {n, num_q_heads, head_dim}, q.options());
    paged_decode_out(q, k_caches[i], v_caches[i], block_tables, context_lens, floats[f], ints[i * kIntsPerLayer],
                     attn);
    const at::Tensor o = project_into(attn.view({n, q_size}), tensors, t + kProjTensors, ints, k + kProjInts,
                                      scratch, kO);
    const at::Tensor post_norm = norm_weight(i, 1);
    normed = scratch.get(kNormed, residual.sizes(), post_norm.options());
    add_rms_norm_out(residual, o, post_norm, floats[f + 2], normed);
    const at::Tensor gate_up = project_into(normed, tensors, t + 2 * kProjTensors, ints, k + 2 * kProjInts, scratch,
                                            kGateUp);
    at::Tensor& act = scratch.get(kAct, {n, gate_up.size(1) / 2}, gate_up.options());
    silu_mul_out(gate_up, act);
    const at::Tensor down = project_into(act, tensors, t + 3 * kProjTensors, ints, k + 3 * kProjInts, scratch, kDown);
    if (i + 1 < layers) {
      const at::Tensor next_norm = norm_weight(i + 1, 0);
      normed = scratch.get(kNormed, residual.sizes(), next_norm.options());
      add_rms_norm_out(residual, down, next_norm, floats[f + kFloatsPerLayer + 1], normed);
    } else {
      add_residual(residual, down);
    }
  }
}

// ---- plans kept here ---------------------------------------------------------------------------------
// A plan's lists (~900 entries for the default model) were parsed from Python objects on every step: ~60 us,
// ~250 us right after a step had streamed its weights and K/V through the caches. register_layer_plan keeps
// them here under a handle (workers/models/layer_plan.py registers a plan once and releases it when the plan
// is collected); decode_planned runs decode_layers with them. Handles are process-wide, under one mutex.
struct StoredPlan {
  c10::List<std::optional<at::Tensor>> tensors;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  int64_t num_q_heads, num_kv_heads, head_dim;
};

std::mutex plans_mutex;
std::unordered_map<int64_t, std::shared_ptr<const StoredPlan>> stored_plans;
int64_t next_plan = 1;

int64_t register_layer_plan(const c10::List<std::optional<at::Tensor>>& tensors, c10::IntArrayRef ints,
                            c10::ArrayRef<double> floats, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim) {
  auto plan = std::make_shared<const StoredPlan>(StoredPlan{tensors.copy(), ints.vec(), floats.vec(), num_q_heads,
                                                           num_kv_heads, head_dim});
  std::lock_guard<std::mutex> lock(plans_mutex);
  stored_plans.emplace(next_plan, std::move(plan));
  return next_plan++;
}

void release_layer_plan(int64_t handle) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  stored_plans.erase(handle);
}

void decode_planned(at::Tensor residual, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                    const at::Tensor& block_tables, const at::Tensor& context_lens, at::TensorList k_caches,
                    at::TensorList v_caches, int64_t handle) {
  std::shared_ptr<const StoredPlan> plan;
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    const auto found = stored_plans.find(handle);
    TORCH_CHECK(found != stored_plans.end(), "decode_planned: no layer plan ", handle);
    plan = found->second;
  }
  decode_layers(std::move(residual), cos, sin, slot_mapping, block_tables, context_lens, k_caches, v_caches,
                plan->tensors, plan->ints, plan->floats, plan->num_q_heads, plan->num_kv_heads, plan->head_dim);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("register_layer_plan(Tensor?[] tensors, int[] ints, float[] floats, int num_q_heads, int num_kv_heads, "
        "int head_dim) -> int");
  m.def("release_layer_plan(int handle) -> ()");
  m.def("decode_planned(Tensor(a!) residual, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, int handle) -> ()");
  m.impl("release_layer_plan", &release_layer_plan);  // no tensor argument: no dispatch key to pick an impl by
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("register_layer_plan", &register_layer_plan);
  m.impl("decode_planned", &decode_planned);
}

// A plan holding an MkldnnCPU tensor (an opaque packed weight, as MKL's packed fp32 ones were) dispatches there.
TORCH_LIBRARY_IMPL(tollway_cpu, MkldnnCPU, m) {
  m.impl("register_layer_plan", &register_layer_plan);
}
