"""The CUDA path on a real GPU (skipped without one; CI has none): the Triton kernels compiled for the
device against the torch reference, and the engine running a model on CUDA (attention through the
Triton kernels) against transformers on the same device.

The CPU suite checks the same kernels in Triton's interpreter; what only a GPU shows is a kernel that
compiles or behaves differently when really compiled (tile shapes, masks, bf16 conversions).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from kernels.dispatch import select_backend
from tests.unit.kernels.test_kernels import FULL_GRID, make_case, tolerance
from workers.engine.config import EngineConfig
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.engine import Engine
from workers.engine.graph_buckets import DEFAULT_BATCH_BUCKETS, MIN_CONTEXT_BUCKET, batch_bucket
from workers.engine.request import FinishReason
from workers.wire.sampling import SamplingParams

pytestmark = pytest.mark.gpu
DEVICE = "cuda:0"


def on_gpu(case):
    for name in ("q", "k", "v", "k_cache", "v_cache"):
        setattr(case, name, getattr(case, name).to(DEVICE))
    meta = case.meta
    for name in ("query_start", "context_lens", "block_tables", "slot_mapping", "positions"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return case


@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype", "batch"), FULL_GRID)
@pytest.mark.parametrize("window", [None, 20])
def test_triton_decode_and_extend_on_gpu_match_reference(group, head_dim, block_size, dtype, batch, window) -> None:
    from kernels.triton import decode as triton_decode
    from kernels.triton import extend as triton_extend

    c = on_gpu(make_case(group, head_dim, block_size, dtype, batch, decode=True, seed=batch + group))
    args = (c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.context_lens, c.scale, window)
    expected = reference.decode_attention(*args)
    torch.testing.assert_close(triton_decode.decode_attention(*args), expected, **tolerance(dtype))
    torch.testing.assert_close(triton_decode.decode_attention(*args, split_len=64), expected, **tolerance(dtype))

    c = on_gpu(make_case(group, head_dim, block_size, dtype, batch, decode=False, seed=batch * group))
    args = (c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.query_start, c.meta.context_lens, c.scale, window)
    torch.testing.assert_close(triton_extend.extend_attention(*args), reference.extend_attention(*args),
                               **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_on_gpu_writes_exact_rows(dtype) -> None:
    from kernels.triton import store as triton_store

    c = on_gpu(make_case(3, 64, 16, dtype, 5, decode=False))
    expected_k, expected_v = c.k_cache.clone(), c.v_cache.clone()
    reference.store_kv(c.k, c.v, expected_k, expected_v, c.meta.slot_mapping)
    k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()
    triton_store.store_kv(c.k, c.v, k_cache, v_cache, c.meta.slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_triton_int8_cache_on_gpu_stores_and_reads_as_the_cpu() -> None:
    """The int8 KV cache compiled for the GPU: store_kv writes kv_int8.quantize's bytes (fp32 division and
    round-half-even on the device, fp16 scales per 16 values), decode and extend read them as the reference
    reads their dequantized copy."""
    from kernels.kv_int8 import dequantize, quantize, row_width
    from kernels.triton import decode as triton_decode
    from kernels.triton import extend as triton_extend
    from kernels.triton import store as triton_store

    torch.manual_seed(3)
    k, v = torch.randn(40, 3, 64) * 3, torch.randn(40, 3, 64)
    width = row_width(64, torch.int8)  # 64 codes and four fp16 scales
    k_cache = torch.zeros(8, 8, 3, width, dtype=torch.int8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(40, device=DEVICE)
    triton_store.store_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 3, width)[:40].cpu(), quantize(k))
    assert torch.equal(v_cache.view(-1, 3, width)[:40].cpu(), quantize(v))
    q = torch.randn(1, 9, 64, device=DEVICE)
    tables = torch.arange(5, dtype=torch.int32, device=DEVICE)[None]
    lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    got = triton_decode.decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    expected = reference.decode_attention(q, dequantize(k_cache, torch.float32), dequantize(v_cache, torch.float32),
                                          tables, lens, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    q_new = torch.randn(8, 9, 64, device=DEVICE)  # the last 8 tokens as one extend over the first 32
    start = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    got = triton_extend.extend_attention(q_new, k_cache, v_cache, tables, start, lens, 0.125)
    expected = reference.extend_attention(q_new, dequantize(k_cache, torch.float32), dequantize(v_cache, torch.float32),
                                          tables, start, lens, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from workers.models.loader import load_model
    from workers.models.tiny import write_tiny_model_folder

    folder = write_tiny_model_folder(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=3)
    ours = load_model(folder, torch.float32, DEVICE)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return ours, theirs.to(DEVICE).eval()


REGIMES = {"batched": EngineConfig(num_blocks=200), "chunked": EngineConfig(num_blocks=200, max_batch_tokens=16),
           "preempting": EngineConfig(num_blocks=12, block_size=8)}


@pytest.mark.parametrize("overlap", ["off", "on"])  # overlapped steps (workers/engine/overlap.py): on by default here
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_engine_on_gpu_matches_transformers_greedy(gpu_pair, regime: str, graphs: bool, overlap: str) -> None:
    config = dataclasses.replace(REGIMES[regime], cuda_graphs=graphs, overlap=overlap)
    ours, theirs = gpu_pair
    assert ours.model.device.type == "cuda" and select_backend(ours.model.device) == "triton"
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 128, (40,), generator=gen).tolist()
    prompts = [system + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 17, 1, 30)]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=DEVICE)
        out = theirs.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    engine = Engine(ours, config)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second round hits the prefix cache
        done = engine.generate_batch(prompts, params)
        assert [s.output_ids for s in done] == expected
        assert all(s.finish_reason is FinishReason.LENGTH for s in done)
        engine.check_integrity()
        assert engine.all_blocks_free_or_evictable()
    assert engine.runner.kv.keys[0].device.type == "cuda" and engine.overlap is (overlap == "on")
    captured = engine.runner.graphs
    if graphs:  # the decode steps were replayed graphs, not eager steps
        assert isinstance(captured, DecodeGraphs) and captured.graphs
    else:
        assert captured is None


def test_captured_decode_gives_the_eager_tokens_with_one_graph_per_bucket(gpu_pair) -> None:
    """Batches of varied sizes: the eager engine's tokens; a graph per batch bucket met (contexts stay
    under the first context bucket), none captured again on a second round of the same batches.
    (A batch prefilled over several steps also meets the buckets of its stragglers, so only the
    small ones' buckets are certain.)"""
    ours, _ = gpu_pair
    gen = torch.Generator().manual_seed(5)
    sizes = [1, 3, 5, 9, 17, 33, 2, 70]  # 70: beyond the largest bucket, eager
    batches = [[torch.randint(3, 128, (int(n),), generator=gen).tolist() for n in torch.randint(2, 60, (size,))]
               for size in sizes]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = Engine(ours, EngineConfig(num_blocks=400))
    graphed = Engine(ours, EngineConfig(num_blocks=400, cuda_graphs=True))
    captured = graphed.runner.graphs
    assert isinstance(captured, DecodeGraphs)
    for round_index in range(2):
        for prompts in batches:
            expected = [s.output_ids for s in eager.generate_batch(prompts, params)]
            assert [s.output_ids for s in graphed.generate_batch(prompts, params)] == expected
        if round_index == 0:
            first_round = set(captured.graphs)
    assert set(captured.graphs) == first_round  # no capture storm: the second round replayed them all
    assert {(batch_bucket(size), MIN_CONTEXT_BUCKET) for size in (1, 3, 5, 9)} <= first_round
    assert all(bucket in DEFAULT_BATCH_BUCKETS and ctx == MIN_CONTEXT_BUCKET for bucket, ctx in first_round)
    graphed.check_integrity()
