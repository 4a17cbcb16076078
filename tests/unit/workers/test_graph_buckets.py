"""Decode buckets (workers/engine/graph_buckets.py): bucket choice, eager fallback beyond the largest
bucket, and padding rows that leave the real rows' logits and K/V untouched (they write only the
reserved dummy block), on the CPU path and the native one; the settings that turn graphs on and
size a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from kernels.cpu import native
from kernels.metadata import PagedAttentionMetadata
from tests.required import unavailable
from workers.engine.config import STEP_TOKENS, EngineConfig, step_token_budget
from workers.engine.engine import Engine
from workers.engine.graph_buckets import batch_bucket, context_bucket, pad_decode_batch
from workers.models.loader import load_model
from workers.models.tiny import write_tiny_model_folder
from workers.paged_step import run_step


def test_bucket_choice_and_eager_fallback() -> None:
    assert [batch_bucket(n) for n in (1, 3, 16, 17, 33, 64)] == [1, 4, 16, 24, 48, 64]
    assert batch_bucket(65) is None
    assert batch_bucket(5, (8, 2)) == 8
    assert [context_bucket(n) for n in (1, 256, 257, 1000)] == [256, 256, 512, 1024]


@pytest.mark.parametrize("backend", ["cpu", "native"])
def test_padding_rows_leave_real_rows_alone(tmp_path: Path, backend) -> None:
    if backend == "native" and not native.load():
        unavailable(str(native.unavailable_reason()))
    model = load_model(write_tiny_model_folder(tmp_path / "m", "llama", seed=2), torch.float32).model
    pool = BlockPool(40, 4)
    dummy_block = pool.allocate(1)[0]
    kv = model.allocate_kv(pool.num_blocks, 4)
    gen = torch.Generator().manual_seed(0)
    tables = [BlockTable(pool) for _ in range(3)]
    run_step(model, kv, tables, [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 11, 2)])
    for t in tables:
        t.append(1)
    meta = PagedAttentionMetadata.build([1] * 3, [t.num_tokens for t in tables], [t.block_ids for t in tables], 4,
                                        backend=backend)
    ids = torch.tensor([7, 8, 9])
    before = [c.clone() for c in (*kv.keys, *kv.values)]
    expected = model(ids, kv, meta)
    after_eager = [c.clone() for c in (*kv.keys, *kv.values)]
    for cache, saved in zip((*kv.keys, *kv.values), before, strict=True):
        cache.copy_(saved)
    padded = pad_decode_batch(ids, meta, batch_bucket(3) or 0, dummy_block, backend)
    assert padded.input_ids.shape == (4,) and padded.num_real == 3
    # extended on the device, it is the metadata a build from the padded lists gives
    built = PagedAttentionMetadata.from_tables([1] * 4, [*meta.context_lens_list, 1], padded.meta.block_tables, 4,
                                               backend)
    for name in ("query_start", "context_lens", "slot_mapping", "positions"):
        got_tensor, built_tensor = getattr(padded.meta, name), getattr(built, name)
        assert got_tensor.dtype == built_tensor.dtype and torch.equal(got_tensor, built_tensor), name
    assert (padded.meta.num_decodes, padded.meta.context_lens_list) == (built.num_decodes, built.context_lens_list)
    assert padded.input_ids.tolist() == [7, 8, 9, 0]
    got = model(padded.input_ids, kv, padded.meta)[: padded.num_real]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for cache, eager in zip((*kv.keys, *kv.values), after_eager, strict=True):
        real = torch.ones(cache.shape[0], dtype=torch.bool)
        real[dummy_block] = False
        # only the dummy block differs (up to the GEMM's rounding, which may depend on the row count)
        torch.testing.assert_close(cache[real], eager[real], atol=1e-5, rtol=1e-5)


def test_graph_and_step_budget_settings_reach_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """TOLLWAY_CUDA_GRAPHS (on by default), TOLLWAY_MAX_BATCH_TOKENS (unset: by device) and TOLLWAY_OVERLAP
    (auto: on CUDA) reach the engine; on a CPU the graphs setting changes nothing and the step budget is the CPU's."""
    from pydantic import ValidationError

    from ops.offline import engine_config
    from workers.settings import WorkerSettings

    config = engine_config(WorkerSettings())
    assert config.cuda_graphs and config.max_batch_tokens is None
    assert step_token_budget(None, "cpu") == STEP_TOKENS["cpu"] == 1024
    assert step_token_budget(None, "cuda") == STEP_TOKENS["cuda"] == 8192
    assert step_token_budget(300, "cuda") == 300
    engine = Engine(load_model(write_tiny_model_folder(tmp_path / "m", "llama"), torch.float32), config)
    assert engine.scheduler.max_batch_tokens == 1024 and engine.runner.graphs is None
    assert config.overlap == "auto" and not engine.overlap  # overlapped steps: on CUDA only by default
    monkeypatch.setenv("TOLLWAY_CUDA_GRAPHS", "false")
    monkeypatch.setenv("TOLLWAY_MAX_BATCH_TOKENS", "2048")
    monkeypatch.setenv("TOLLWAY_OVERLAP", "on")
    config = engine_config(WorkerSettings())
    assert not config.cuda_graphs and config.max_batch_tokens == 2048
    engine = Engine(load_model(tmp_path / "m", torch.float32), config)
    assert engine.scheduler.max_batch_tokens == 2048 and engine.overlap
    monkeypatch.setenv("TOLLWAY_OVERLAP", "sometimes")
    with pytest.raises(ValidationError):
        WorkerSettings()
    monkeypatch.setenv("TOLLWAY_OVERLAP", "off")
    monkeypatch.setenv("TOLLWAY_MAX_BATCH_TOKENS", "0")
    with pytest.raises(ValidationError):
        WorkerSettings()


def test_captured_steps_find_the_rotary_tables_where_they_were(tmp_path: Path) -> None:
    """A graph reads the rotary tables at their capture addresses, so DecodeGraphs makes them reach the
    longest context the cache holds before any capture: a later step with a long context finds them in
    place (the tables start at 4,096 positions and used to double, moving, when a context passed that).
    Gemma's second (local) table: tests/unit/workers/test_architectures.py."""
    from workers.engine.cuda_graphs import DecodeGraphs

    model = load_model(write_tiny_model_folder(tmp_path / "m", "llama", max_position_embeddings=8192),
                       torch.float32).model
    kv = model.allocate_kv(701, 8)
    assert model.rotary._cos.shape[0] == 4096
    DecodeGraphs(model, kv, 700, "cpu")
    where = model.rotary._cos.data_ptr()
    assert model.rotary._cos.shape[0] >= 700 * 8
    model.rotary.gather(torch.tensor([700 * 8 - 1]), 700 * 8 - 1, torch.float32)
    assert model.rotary._cos.data_ptr() == where


def test_a_failed_capture_falls_back_to_eager_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A capture that raises (as CUDA does for a step that syncs with the host) leaves the engine decoding
    eagerly with the same tokens, says why once, and tries no capture again. Here on the CPU stand-in."""
    from workers.engine.cuda_graphs import DecodeGraphs
    from workers.engine.runner import ModelRunner
    from workers.wire.sampling import SamplingParams

    loaded = load_model(write_tiny_model_folder(tmp_path / "m", "llama", seed=1), torch.float32)
    prompts = [[5, 9, 11, 40], [7, 8, 3, 99, 100, 20], [12]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [s.output_ids for s in Engine(loaded, EngineConfig(num_blocks=40)).generate_batch(prompts, params)]
    engine = Engine(loaded, EngineConfig(num_blocks=40))
    kv = loaded.model.allocate_kv(41, engine.runner.kv.block_size)
    graphs = DecodeGraphs(loaded.model, kv, 40, "cpu", buckets=(4,))
    attempts = []

    def refuse(bucket: int, ctx: int) -> None:
        attempts.append(bucket)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", refuse)
    engine.runner = ModelRunner(loaded.model, kv, "cpu", graphs)
    with caplog.at_level("WARNING", logger="workers.engine.cuda_graphs"):
        assert [s.output_ids for s in engine.generate_batch(prompts, params)] == expected
    assert attempts == [4] and graphs.failed is not None and not graphs.graphs
    assert "decoding eagerly" in caplog.text
