"""The decode step's layers as one native call (workers/models/layer_plan.py, kernels/cpu/native/layer_stack.cpp)
against the Python loop of the same ops (`fused_decode.decode_layers`): bit-equal hidden states and K/V for
every kind of projection the op runs (plain, packed, fp32 few rows, int4 and int8 row kernels with float or int8
activations),
with a sliding window; no plan where a projection has no kind, and a plan rebuilt when projections are replaced.
Needs the native library (tests/required.py: skipped locally without a compiler, a failure on CI)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from kernels.metadata import PagedAttentionMetadata
from kernels.quantized import cpu as quantized_cpu
from tests.required import require_native
from workers.models import fused_decode, packed_linear, quantized_linear
from workers.models.layer_plan import PROJECTIONS, LayerPlan, build_plan, plan_for
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import load_model
from workers.models.packed_linear import pack_linears, packing_kind
from workers.paged_step import run_step


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    require_native()


def model_for(tmp_path: Path, dtype: torch.dtype, quantization: str, activations: str,
              window: int | None) -> LlamaForCausalLM:
    from workers.models.tiny import write_tiny_model_folder

    overrides = {"sliding_window": window} if window else {}
    folder = write_tiny_model_folder(tmp_path / "m", "mistral" if window else "llama", seed=5, **overrides)
    return load_model(folder, dtype, quantization=quantization, activations=activations).model


def both_ways(model: LlamaForCausalLM, lengths: tuple[int, ...] = (3, 17, 40, 9, 30),
              ) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], ...]:
    """One decode step of sequences of `lengths` tokens from the same prefilled cache, by the plan and by the
    Python loop: each way's hidden states and its caches after the step."""
    pool = BlockPool(-(-sum(lengths) // 8) + 2 * len(lengths), 8)
    kv = model.allocate_kv(pool.num_blocks, pool.block_size)
    gen = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]
    tables = [BlockTable(pool) for _ in batch]
    run_step(model, kv, tables, batch, backend="cpu")
    for table in tables:
        table.append(1)
    meta = PagedAttentionMetadata.build([1] * len(batch), [t.num_tokens for t in tables],
                                        [t.block_ids for t in tables], pool.block_size, backend="native")
    input_ids = torch.tensor([5, 9, 17, 33, 65] * -(-len(lengths) // 5))[: len(lengths)]
    cos, sin = model.rotary.gather(meta.positions, meta.max_context_len - 1, model.dtype)
    results = []
    for way in ("plan", "loop"):
        step_kv = model.allocate_kv(kv.num_blocks, kv.block_size, kv.keys[0].dtype)
        for dst, src in zip([*step_kv.keys, *step_kv.values], [*kv.keys, *kv.values], strict=True):
            dst.copy_(src)
        with torch.inference_mode(), quantized_cpu.decode_step():
            if way == "plan":
                assert plan_for(model, len(batch)) is not None
                hidden = fused_decode.decode_hidden(model, input_ids, step_kv, meta, cos, sin)
            else:
                hidden = fused_decode.decode_layers(model, input_ids, step_kv, meta.slot_mapping, meta.block_tables,
                                                    meta.context_lens, cos.squeeze(1), sin.squeeze(1))
        results.append((hidden, [*step_kv.keys, *step_kv.values]))
    return tuple(results)


CASES = pytest.mark.parametrize(
    ("dtype", "quantization", "activations", "window", "pack"),
    [
        (torch.float32, "none", "int8", None, False),  # nn.Linear
        (torch.float32, "none", "int8", None, True),  # fp32 packed: few_rows_linear at 5 rows
        (torch.float32, "none", "int8", None, "many"),  # fp32 packed past its few rows: F.linear
        (torch.bfloat16, "none", "int8", None, True),  # oneDNN's packed bf16, where this CPU has it
        # 260 rows on 2 threads: on an AMX CPU o_proj and down_proj split by rows across them (layer_stack.cpp)
        (torch.bfloat16, "none", "int8", None, "split"),
        (torch.bfloat16, "none", "int8", None, "bf16-few"),  # bf16 few_rows_linear, where this CPU has it
        # 20 and 36 rows: its column tiles, into the step's reused buffers (layer_stack.cpp)
        (torch.bfloat16, "none", "int8", None, "bf16-tiles"),
        (torch.float32, "none", "int8", 12, False),  # a sliding window shorter than most contexts
        (torch.float32, "int4", "int8", None, False),  # int4_matmul_q8
        (torch.bfloat16, "int4", "float", None, False),  # int4_matmul
        (torch.float32, "int8", "int8", None, False),  # int8_matmul_q8
        (torch.bfloat16, "int8", "float", None, False),  # int8_matmul
    ],
    ids=["linear", "few-rows", "many-rows", "mkldnn", "mkldnn-split", "bf16-few-rows", "bf16-tiles", "window", "int4-q8", "int4",
         "int8-q8", "int8"],
)


@CASES
def test_plan_equals_the_python_loop(tmp_path: Path, dtype: torch.dtype, quantization: str, activations: str,
                                     window: int | None, pack: bool | str, monkeypatch: pytest.MonkeyPatch,
                                     request: pytest.FixtureRequest) -> None:
    if pack == "many":  # the step's 5 rows are past the limit
        monkeypatch.setattr(packed_linear, "FEW_ROWS_MAX_ROWS", 4)
    if pack in ("bf16-few", "bf16-tiles"):  # the step's rows on the bf16 kernel (1-4 and 16-48 in use)
        monkeypatch.setattr(packed_linear, "BF16_FEW_ROWS", frozenset(range(1, 49)))
        monkeypatch.setattr(packed_linear, "BF16_FEW_ROWS_HEAD", frozenset(range(1, 49)))
    model = model_for(tmp_path, dtype, quantization, activations, window)
    if pack:  # bf16 packing needs AVX512-BF16 or AMX: elsewhere the layers stay nn.Linear, still compared
        assert pack_linears(model) == (packing_kind(dtype) is not None)
    batches = [(3, 17, 40, 9, 30) * 4, (3, 17, 40, 9, 30, 11) * 6] if pack == "bf16-tiles" else [(3, 17, 40, 9, 30)]
    if pack == "split":
        batches = [(3, 17, 40, 9, 30) * 52]
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        request.addfinalizer(lambda: torch.set_num_threads(threads))
    for lengths in batches:
        if str(pack).startswith("bf16-") and packed_linear.bf16_few_rows_available():
            plan = plan_for(model, len(lengths))
            assert plan is not None and set(projection_kinds(plan)) == {2}  # few_rows_linear, not oneDNN
        (plan_hidden, plan_kv), (loop_hidden, loop_kv) = both_ways(model, lengths)
        assert torch.equal(plan_hidden, loop_hidden)
        for a, b in zip(plan_kv, loop_kv, strict=True):
            assert torch.equal(a, b)


def test_no_plan_where_a_projection_dequantizes_and_a_new_plan_after_packing(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_for(tmp_path, torch.float32, "int4", "int8", None)
    with quantized_cpu.decode_step():
        assert plan_for(model, 4) is not None
        # from 4 rows the quantized layers dequantize and run one GEMM: no kind of the op covers that
        monkeypatch.setattr(quantized_linear, "dequantize_from_rows", lambda packed, rounded: 4)
        assert plan_for(model, 5) is None
    plain = model_for(tmp_path / "plain", torch.float32, "none", "int8", None)
    first = plan_for(plain, 3)
    assert first is not None and plan_for(plain, 3) is first  # kept while the projections stay
    assert set(projection_kinds(first)) == {0}  # nn.Linear
    assert pack_linears(plain)
    second = plan_for(plain, 3)
    assert second is not None and set(projection_kinds(second)) == {2}  # fp32 packed, few rows: few_rows_linear
    many = plan_for(plain, packed_linear.FEW_ROWS_MAX_ROWS + 1)
    assert many is not None and set(projection_kinds(many)) == {0}  # past them: F.linear on the plain weight


def projection_kinds(plan: LayerPlan) -> list[int]:
    """Each projection's kind: per layer the ints are the window, then (kind, int, int) per projection."""
    per_layer = 1 + 3 * len(PROJECTIONS)
    return [plan.ints[start + 1 + 3 * p] for start in range(0, len(plan.ints), per_layer) for p in range(len(PROJECTIONS))]


def test_a_collected_plan_releases_its_lists_in_the_library(tmp_path: Path) -> None:
    model = model_for(tmp_path, torch.float32, "none", "int8", None)
    plan = build_plan(model, 2)
    assert plan is not None
    handle, other = plan.handle, build_plan(model, 2)
    assert other is not None and other.handle != handle  # each plan its own lists
    residual = torch.zeros(2, model.config.hidden_size)
    del plan
    gc.collect()
    with pytest.raises(RuntimeError, match="no layer plan"):
        torch.ops.tollway_cpu.decode_planned(residual, residual, residual, torch.zeros(2, dtype=torch.long),
                                             torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                                             [], [], handle)
