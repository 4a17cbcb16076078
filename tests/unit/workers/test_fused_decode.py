"""The fused native decode step (workers/models/fused_decode.py, packed linears) against the eager
step on the same batch and KV state: same logits (fp32 within 1e-4; bf16 within bf16 rounding),
same argmax tokens, same K/V written; and the engine's greedy tokens on `native` equal `cpu`'s.
Needs the native library (tests/required.py: skipped locally without a compiler, a failure on CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from cache.kv_storage import KVStorage
from kernels.kv_int8 import dequantize
from kernels.metadata import PagedAttentionMetadata
from tests.required import require_native
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models import fused_decode
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import load_model
from workers.models.packed_linear import PackedLinear, pack_linears, packing_kind
from workers.paged_step import run_step
from workers.wire.sampling import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    require_native()


def prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 64)]


MODELS = pytest.mark.parametrize(
    ("model_type", "dtype", "overrides"),
    [
        ("llama", torch.float32, {}),
        ("llama", torch.bfloat16, {}),
        ("qwen2", torch.float32, {}),  # q/k/v bias
        ("mistral", torch.float32, {"sliding_window": 12}),  # window shorter than most contexts
        ("llama", torch.float32, {"head_dim": 32, "num_attention_heads": 8, "num_key_value_heads": 1}),  # group 8
    ],
    ids=["llama-fp32", "llama-bf16", "qwen2-bias", "mistral-window", "group-8"],
)


def tiny_model(tmp_path: Path, model_type: str, dtype: torch.dtype, overrides: dict[str, int]) -> LlamaForCausalLM:
    from workers.models.tiny import write_tiny_model_folder

    if "head_dim" in overrides:
        overrides = {**overrides, "hidden_size": overrides["head_dim"] * overrides["num_attention_heads"]}
    return load_model(write_tiny_model_folder(tmp_path / "m", model_type, seed=5, **overrides), dtype).model


def assert_native_step_equals_eager(model: LlamaForCausalLM, kv: KVStorage, tables: list[BlockTable],
                                    new_tokens: list[list[int]], dtype: torch.dtype) -> None:
    """Run one step of `new_tokens` (already appended to `tables`) on the `cpu` backend (eager layers) and
    on `native` (the fused ops), each from a copy of `kv`: same logits for every token (fp32 within 1e-4;
    bf16 within bf16 rounding), the same argmax (bf16: off near-ties), the same K/V written."""
    input_ids = torch.tensor([t for tokens in new_tokens for t in tokens])
    results = []
    for backend in ("cpu", "native"):
        if backend == "native":
            # packed where this CPU has a packed GEMM for the dtype (bf16 needs AVX512-BF16/AMX); else plain
            packs = packing_kind(dtype) is not None
            assert pack_linears(model) == packs and isinstance(model.lm_head, PackedLinear) == packs
        step_kv = model.allocate_kv(kv.num_blocks, kv.block_size, kv.keys[0].dtype)
        for dst, src in zip([*step_kv.keys, *step_kv.values], [*kv.keys, *kv.values], strict=True):
            dst.copy_(src)
        meta = PagedAttentionMetadata.build([len(t) for t in new_tokens], [t.num_tokens for t in tables],
                                            [t.block_ids for t in tables], kv.block_size, backend=backend)
        all_decode = meta.num_decodes == meta.num_seqs
        cache_dtype = kv.keys[0].dtype
        assert fused_decode.can_fuse_layers(model, meta, cache_dtype) == (backend == "native")
        assert fused_decode.can_fuse(model, meta, cache_dtype) == (backend == "native" and all_decode)
        results.append((model(input_ids, step_kv, meta), step_kv))
    (eager, eager_kv), (fused, fused_kv) = results
    close = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    torch.testing.assert_close(fused, eager, **close)
    # The same argmax, but in bf16 not at a near-tie of eager's top two (closer than 0.01, a third of bf16's
    # step at these logits; a 3e-4 tie of the tiny random model flipped): there, one of the two.
    top2 = eager.float().topk(2, dim=-1)
    tie = top2.values[:, 0] - top2.values[:, 1] < (0.0 if dtype == torch.float32 else 0.01)
    assert torch.equal(fused.argmax(-1)[~tie], eager.argmax(-1)[~tie])
    assert bool((top2.indices[tie] == fused.argmax(-1)[tie, None]).any(-1).all())
    for a, b in zip([*fused_kv.keys, *fused_kv.values], [*eager_kv.keys, *eager_kv.values], strict=True):
        if a.dtype == torch.int8:  # rows of codes and a scale: compare what they hold
            a, b = dequantize(a, torch.float32), dequantize(b, torch.float32)
        torch.testing.assert_close(a, b, **close)


@MODELS
def test_fused_step_equals_eager_step(tmp_path: Path, model_type: str, dtype: torch.dtype,
                                      overrides: dict[str, int]) -> None:
    model = tiny_model(tmp_path, model_type, dtype, overrides)
    block_size = 8
    pool = BlockPool(64, block_size)
    kv = model.allocate_kv(pool.num_blocks, block_size)
    batch = prompts(1)
    tables = [BlockTable(pool) for _ in batch]
    run_step(model, kv, tables, batch, backend="cpu")  # prefill
    for table in tables:
        table.append(1)
    assert_native_step_equals_eager(model, kv, tables, [[5], [9], [17], [33], [65]], dtype)


@MODELS
@pytest.mark.parametrize("cache", ["model", "int8"])
@pytest.mark.parametrize("extends_as", ["rows", "sdpa"])
def test_mixed_step_on_native_ops_equals_eager_step(tmp_path: Path, model_type: str, dtype: torch.dtype,
                                                    overrides: dict[str, int], cache: str, extends_as: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of decodes, a prompt's second chunk (over its cached first chunk) and a fresh prompt runs
    the native ops (`step_hidden`) and gives every token the eager step's logits and K/V, on a cache of
    the model's dtype and on an int8 one (whose fresh prompt attends over its rounded K/V on both paths:
    tests/unit/kernels/test_kv_int8.py checks the eager one against the reference). The extending
    sequences attend both ways `step_hidden` has: as decode rows (short contexts) and by SDPA (long ones,
    forced here by a threshold of 0)."""
    if extends_as == "sdpa":
        monkeypatch.setattr(fused_decode, "ROWS_ATTENTION_MAX_CONTEXT", 0)
        monkeypatch.setattr(fused_decode, "BF16_TILES_MAX_CONTEXT", 0)
    else:  # the contexts here are short: the fused step must not reach the SDPA path

        def no_sdpa(*args: object) -> None:
            raise AssertionError("the extends of short contexts attend as decode rows")

        monkeypatch.setattr(fused_decode.native, "extend_step", no_sdpa)
    model = tiny_model(tmp_path, model_type, dtype, overrides)
    block_size = 8
    pool = BlockPool(64, block_size)
    kv = model.allocate_kv(pool.num_blocks, block_size, torch.int8 if cache == "int8" else None)
    batch = prompts(4)
    tables = [BlockTable(pool) for _ in batch]
    first = [*batch[:3], batch[4][:30]]  # three prompts done, the fifth's first chunk
    run_step(model, kv, tables[:3] + tables[4:], first, backend="cpu")
    new = [[5], [9], [17], batch[4][30:], batch[3]]  # decodes first, then the extends
    order = [*tables[:3], tables[4], tables[3]]
    for table, tokens in zip(order, new, strict=True):
        table.append(len(tokens))
    assert_native_step_equals_eager(model, kv, order, new, dtype)


def test_engine_greedy_tokens_equal_on_native_and_cpu(tmp_path: Path) -> None:
    from workers.models.tiny import write_tiny_model_folder

    folder = write_tiny_model_folder(tmp_path / "m", "llama", seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("cpu", "native"):
        engine = Engine(load_model(folder, torch.float32), EngineConfig(num_blocks=200, attention=backend))
        assert engine.runner.backend == backend
        outputs[backend] = [s.output_ids for s in engine.generate_batch(prompts(2), params)]
        engine.check_integrity()
    assert outputs["native"] == outputs["cpu"]


def test_extends_attend_as_rows_up_to_the_bound_of_their_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`step_hidden` sends a bf16 model's extends over a bf16 cache to the rows (as bf16 tiles) up to
    BF16_TILES_MAX_CONTEXT tokens where the CPU has AVX512-BF16 and either no AMX or AMX running the tiles too
    (head dims of whole 64s, TOLLWAY_PREFILL_PRODUCTS not `bf16`); every other pairing (or a CPU without
    AVX512-BF16, or AMX with the vdpbf16ps tiles, whose SDPA is faster) up to ROWS_ATTENTION_MAX_CONTEXT, and
    longer ones to SDPA."""
    require_native()
    head_32 = {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    bf16 = tiny_model(tmp_path / "bf16", "llama", torch.bfloat16, head_32)
    bf16_64 = tiny_model(tmp_path / "bf16_64", "llama", torch.bfloat16, {**head_32, "head_dim": 64})
    windowed = tiny_model(tmp_path / "window", "mistral", torch.bfloat16, {**head_32, "sliding_window": 12})
    head_16 = tiny_model(tmp_path / "head16", "llama", torch.bfloat16, {"head_dim": 16, "num_attention_heads": 4,
                                                                         "num_key_value_heads": 2})
    fp32 = tiny_model(tmp_path / "fp32", "llama", torch.float32, head_32)
    rows, tiles = fused_decode.ROWS_ATTENTION_MAX_CONTEXT, fused_decode.BF16_TILES_MAX_CONTEXT
    assert tiles > rows
    native, amx = fused_decode.native, fused_decode.cpu_has_amx_bf16()
    with_tiles = tiles if native.tile_matmul_available() else rows
    assert fused_decode.rows_attention_max_context(bf16, bf16.allocate_kv(4, 8, None)) == (rows if amx else with_tiles)
    on_amx = with_tiles if native.amx_rows_available() else rows
    assert fused_decode.rows_attention_max_context(bf16_64, bf16_64.allocate_kv(4, 8, None)) == (
        on_amx if amx else with_tiles)

    def bound(model: object, cpu_amx: bool, amx_tiles: bool, products: str | None) -> int:
        monkeypatch.setattr(fused_decode, "cpu_has_amx_bf16", lambda: cpu_amx)
        monkeypatch.setattr(native, "amx_rows_available", lambda: amx_tiles)
        if products is None:
            monkeypatch.delenv("TOLLWAY_PREFILL_PRODUCTS", raising=False)
        else:
            monkeypatch.setenv("TOLLWAY_PREFILL_PRODUCTS", products)
        return fused_decode.rows_attention_max_context(model, model.allocate_kv(4, 8, None))  # type: ignore[attr-defined]

    assert bound(bf16, False, False, None) == with_tiles  # no AMX: the vdpbf16ps tiles
    assert bound(bf16, True, True, None) == rows  # AMX, head dim 32: vdpbf16ps tiles, SDPA faster past 512
    assert bound(bf16_64, True, True, None) == with_tiles  # AMX tiles
    assert bound(bf16_64, True, True, "bf16") == rows  # asked for the vdpbf16ps tiles
    assert bound(bf16_64, True, False, None) == rows  # AMX the kernel cannot use
    monkeypatch.delenv("TOLLWAY_PREFILL_PRODUCTS", raising=False)
    assert fused_decode.rows_attention_max_context(bf16, bf16.allocate_kv(4, 8, torch.int8)) == rows
    for other in (windowed, head_16, fp32):  # no tiles: a window, a head dim under 32, fp32 (its own tiles: 512)
        assert fused_decode.rows_attention_max_context(other, other.allocate_kv(4, 8, None)) == rows
