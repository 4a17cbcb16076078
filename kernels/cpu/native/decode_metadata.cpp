// torch.ops.tollway_cpu.decode_metadata: an all-decode step's paged-attention metadata in one call
// (workers/engine/table_rows.py `BlockTableRows.decode_metadata`).
//
// Each sequence s has one new token, its rows[row_index[s]] the persistent mirror of its block table and
// context_lens[s] tokens after the step. Returns (block_tables [S, width] int32: the rows' first `width`
// entries, context_lens [S] int32, positions [S] int64 = context - 1, slot_mapping [S] int64: the token's
// block times block_size plus its offset, query_start [S + 1] int32 = 0..S): what
// PagedAttentionMetadata.from_tables computes for such a step with a dozen small torch ops, each of which,
// right after a step's weights and K/V have streamed through the caches, cost tens of microseconds of
// cold dispatch (the runner's metadata took ~0.5 ms of a 45 ms batch-32 step on a 2-core EPYC).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_metadata(
    const at::Tensor& rows, c10::IntArrayRef row_index, c10::IntArrayRef context_lens, int64_t width,
    int64_t block_size) {
  const int64_t S = static_cast<int64_t>(row_index.size());
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == at::kInt && rows.is_cpu(),
              "decode_metadata: rows must be a contiguous int32 CPU [R, W]");
  TORCH_CHECK(static_cast<int64_t>(context_lens.size()) == S && S > 0, "decode_metadata: one context length per row");
  TORCH_CHECK(0 < width && width <= rows.size(1) && block_size > 0, "decode_metadata: bad width or block size");
  const int64_t R = rows.size(0), W = rows.size(1);
  at::Tensor tables = at::empty({S, width}, rows.options());
  at::Tensor lens = at::empty({S}, rows.options());
  at::Tensor positions = at::empty({S}, rows.options().dtype(at::kLong));
  at::Tensor slots = at::empty({S}, rows.options().dtype(at::kLong));
  at::Tensor query_start = at::empty({S + 1}, rows.options());
  const int32_t* src = rows.data_ptr<int32_t>();
  int32_t* tp = tables.data_ptr<int32_t>();
  int32_t* lp = lens.data_ptr<int32_t>();
  int64_t* pp = positions.data_ptr<int64_t>();
  int64_t* sp = slots.data_ptr<int64_t>();
  int32_t* qp = query_start.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t r = row_index[s], context = context_lens[s];
    TORCH_CHECK(0 <= r && r < R, "decode_metadata: row ", r, " out of range");
    TORCH_CHECK(1 <= context && context <= width * block_size, "decode_metadata: context ", context,
                " does not fit ", width, " blocks of ", block_size);
    const int32_t* row = src + r * W;
    std::copy(row, row + width, tp + s * width);
    const int64_t position = context - 1;
    lp[s] = static_cast<int32_t>(context);
    pp[s] = position;
    sp[s] = static_cast<int64_t>(row[position / block_size]) * block_size + position % block_size;
    qp[s] = static_cast<int32_t>(s);
  }
  qp[S] = static_cast<int32_t>(S);
  return {tables, lens, positions, slots, query_start};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tollway_cpu, m) {
  m.def("decode_metadata(Tensor rows, int[] row_index, int[] context_lens, int width, int block_size) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tollway_cpu, CPU, m) {
  m.impl("decode_metadata", &decode_metadata);
}
