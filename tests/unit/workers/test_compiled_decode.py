"""The torch.compile'd decode step (workers/engine/compiled_decode.py) on the tiny model, on both
CPU backends: it gives the eager step's logits (fp32 within 1e-4) and tokens on the same batch and
KV state, and the engine's greedy tokens are those of the eager engine; varied batch sizes compile
one graph per bucket used, never more (no recompilation storm: dynamo's own graph counter agrees).
The native backend needs the native library (tests/required.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from kernels.cpu import native
from kernels.metadata import PagedAttentionMetadata
from tests.required import unavailable
from workers.engine.compiled_decode import CompiledDecode
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.graph_buckets import batch_bucket
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import load_model
from workers.models.packed_linear import pack_linears
from workers.paged_step import run_step
from workers.wire.sampling import SamplingParams

BLOCK = 8


def tiny_model(tmp_path: Path, backend: str) -> LlamaForCausalLM:
    from workers.models.tiny import write_tiny_model_folder

    if backend == "native" and not native.load():
        unavailable(str(native.unavailable_reason()))
    model = load_model(write_tiny_model_folder(tmp_path / "m", "llama", seed=5), torch.float32).model
    if backend == "native":
        assert pack_linears(model)  # as the engine runs the native step
    return model


def prefilled(model: LlamaForCausalLM, lengths: list[int], num_blocks: int = 0):  # type: ignore[no-untyped-def]
    """A pool with a reserved dummy block, KV holding one prompt per length, each table one token longer."""
    pool = BlockPool(max(num_blocks, sum(n // BLOCK + 2 for n in lengths) + 1), BLOCK)
    dummy_block = pool.allocate(1)[0]
    kv = model.allocate_kv(pool.num_blocks, BLOCK)
    gen = torch.Generator().manual_seed(1)
    tables = [BlockTable(pool) for _ in lengths]
    run_step(model, kv, tables, [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths],
             backend="cpu")
    for table in tables:
        table.append(1)
    return kv, tables, dummy_block


def decode_meta(tables: list[BlockTable], backend: str) -> PagedAttentionMetadata:
    return PagedAttentionMetadata.build([1] * len(tables), [t.num_tokens for t in tables],
                                        [t.block_ids for t in tables], BLOCK, backend=backend)  # type: ignore[arg-type]


@pytest.mark.slow  # each compile takes 8-40 s on the 2-core host
@pytest.mark.parametrize("backend", ["cpu", "native"])
def test_compiled_step_equals_eager_step(tmp_path: Path, backend: str) -> None:
    model = tiny_model(tmp_path, backend)
    kv, tables, dummy_block = prefilled(model, [3, 17, 40, 9, 64], num_blocks=163)
    ids = torch.tensor([5, 9, 17, 33, 65])
    saved = [c.clone() for c in (*kv.keys, *kv.values)]
    eager = model(ids, kv, decode_meta(tables, backend))
    eager_kv = [c.clone() for c in (*kv.keys, *kv.values)]
    for cache, before in zip((*kv.keys, *kv.values), saved, strict=True):
        cache.copy_(before)
    compiled = CompiledDecode(model, kv, dummy_block, backend)  # type: ignore[arg-type]
    got, codes = run_and_get_code(compiled.run, ids, decode_meta(tables, backend), torch.arange(5))
    assert got is not None, compiled.failed
    # The K/V writes happen in place: no kernel of the step loops over a whole cache (163 * 8 * 2 * 16
    # = 41728 elements), as it would to copy back a functionalised (out-of-place) write.
    assert codes and not any(str(kv.keys[0].numel()) in code for code in codes)
    assert compiled.num_variants == 1 and batch_bucket(5) == 8  # padded with three dummy rows
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    real = torch.ones(kv.num_blocks, dtype=torch.bool)
    real[dummy_block] = False  # padding rows write only there
    for cache, expected in zip((*kv.keys, *kv.values), eager_kv, strict=True):
        torch.testing.assert_close(cache[real], expected[real], atol=1e-5, rtol=1e-5)
    # a prefill step is not the compiled step's
    assert compiled.run(ids[:2], PagedAttentionMetadata.build([2], [2], [[1]], BLOCK, backend=backend),  # type: ignore[arg-type]
                        torch.tensor([1])) is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "native"])
def test_engine_greedy_tokens_equal_with_compile_on(tmp_path: Path, backend: str) -> None:
    from workers.models.tiny import write_tiny_model_folder

    if backend == "native" and not native.load():
        unavailable(str(native.unavailable_reason()))
    folder = write_tiny_model_folder(tmp_path / "m", "llama", seed=3)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (7, 30, 12)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for mode in ("off", "decode"):
        engine = Engine(load_model(folder, torch.float32),
                        EngineConfig(num_blocks=100, attention=backend, compile=mode))  # type: ignore[arg-type]
        outputs[mode] = [s.output_ids for s in engine.generate_batch(prompts, params)]
        engine.check_integrity()
        if mode == "decode":
            compiled = engine.runner.graphs
            assert isinstance(compiled, CompiledDecode) and compiled.failed is None
            assert compiled.num_variants == 1  # three decodes: bucket 4, contexts under 256
    assert outputs["decode"] == outputs["off"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "native"])
def test_varied_batch_sizes_compile_once_per_bucket(tmp_path: Path, backend: str) -> None:
    model = tiny_model(tmp_path, backend)
    buckets = (4, 16, 40)
    lengths = [5 + 3 * i for i in range(44)]  # contexts 6 ... 135: one context bucket (256)
    kv, tables, dummy_block = prefilled(model, lengths)
    torch._dynamo.reset()
    counters.clear()
    compiled = CompiledDecode(model, kv, dummy_block, backend, buckets)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(4)
    sizes = [*range(1, 45), 37, 2, 16, 17]  # every size up to past the largest bucket, some again
    ran = 0
    for size in sizes:
        part = tables[:size]
        ids = torch.randint(3, 128, (size,), generator=gen)
        logits = compiled.run(ids, decode_meta(part, backend), torch.arange(size))
        if size > buckets[-1]:
            assert logits is None  # beyond the largest bucket: eager
            continue
        assert logits is not None and logits.shape == (size, model.config.vocab_size), compiled.failed
        ran += 1
    assert ran == len(sizes) - 4
    assert compiled.num_variants == len(buckets)
    # dynamo's count of graphs compiled for the step: one per bucket, no recompiles beyond them
    assert counters["stats"]["unique_graphs"] == len(buckets)


@pytest.mark.slow
def test_compiled_quantized_step_takes_the_decode_steps_kernels(tmp_path: Path) -> None:
    """An int4 model's compiled step runs the kernels an eager decode step runs: the int8-activation ones
    (AVX512-VNNI's or AVX2's, chosen while tracing, kernels/quantized/cpu.in_decode_step); its logits are
    the eager decode step's to bf16 rounding where both refine them."""
    from kernels.quantized import cpu as quantized_cpu
    from workers.models.logits_refine import REFINED_TOP
    from workers.models.tiny import write_tiny_model_folder

    if not native.load():
        unavailable(str(native.unavailable_reason()))
    folder = write_tiny_model_folder(tmp_path / "m", "llama", seed=5)
    model = load_model(folder, torch.bfloat16, quantization="int4").model
    kv, tables, dummy_block = prefilled(model, [3, 17, 40], num_blocks=40)
    ids = torch.tensor([5, 9, 17])
    saved = [c.clone() for c in (*kv.keys, *kv.values)]
    with quantized_cpu.decode_step():
        eager = model(ids, kv, decode_meta(tables, "native"))
    for cache, before in zip((*kv.keys, *kv.values), saved, strict=True):
        cache.copy_(before)
    torch._dynamo.reset()
    compiled = CompiledDecode(model, kv, dummy_block, "native")
    got, codes = run_and_get_code(compiled.run, ids, decode_meta(tables, "native"), torch.arange(3))
    assert got is not None, compiled.failed
    assert any("int4_matmul" in code for code in codes)
    assert any("int4_matmul_q8" in code for code in codes)  # decode steps round x to int8 (quantized_q8.cpp)
    # the head's int4 copy gives every logit, its top REFINED_TOP refined in fp32 (workers/models/quantized_head.py):
    # well inside that set both agree to bf16 rounding; near its edge a logit may be refined in one and not the
    # other (measured: eager's 58th largest, 0.36 apart), so the rest agree to the copy's rounding
    top = eager.float().topk(REFINED_TOP // 4, dim=-1).indices
    torch.testing.assert_close(got.float().gather(1, top), eager.float().gather(1, top), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(got.float(), eager.float(), atol=1.0, rtol=5e-2)


def test_compile_setting_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from ops.offline import engine_config
    from workers.settings import WorkerSettings

    assert engine_config(WorkerSettings()).compile == "off"
    monkeypatch.setenv("TOLLWAY_COMPILE", "decode")
    assert engine_config(WorkerSettings()).compile == "decode"
    monkeypatch.setenv("TOLLWAY_COMPILE", "everything")
    with pytest.raises(ValidationError):
        WorkerSettings()
