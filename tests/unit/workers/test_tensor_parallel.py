"""Tensor parallelism (issue 26): a tiny random-weight Llama folder (transformers' own config class,
the default model's real tokenizer) run on 2 gloo ranks on the CPU gives the same tokens as the
single-process model in fp32, through the engine (several KV blocks, a prefix hit, forked choices,
prompt logprobs) and through `tollway generate`; sizes the model cannot be split by are clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from click.testing import CliRunner

from ops.cli import cli
from tests.unit.workers.test_architectures import COMMON, TOKENIZER_FILES, randomize
from workers.engine.config import EngineConfig
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.engine import Engine
from workers.engine.runner import ModelRunner
from workers.models.config import ModelConfig
from workers.models.loader import LoadedModel, load_model
from workers.parallel.launch import start_tensor_parallel
from workers.parallel.layers import TensorParallelError, check_tensor_parallel
from workers.parallel.model import ShardedLlamaForCausalLM
from workers.settings import WorkerSettings
from workers.wire.sampling import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory, smollm2_folder: Path) -> Path:
    """4 query / 2 KV heads; the vocabulary one row larger than the tokenizer's, so it is odd and the
    last rank's vocabulary shard is padded."""
    folder = tmp_path_factory.mktemp("tp-llama")
    vocab = len(transformers.PreTrainedTokenizerFast(tokenizer_file=str(smollm2_folder / "tokenizer.json"))) + 1
    config = transformers.LlamaConfig(vocab_size=vocab, **{**COMMON, "tie_word_embeddings": True})
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model, seed=3)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_folder / name, folder / name)
    return folder


def run_engine(loaded: LoadedModel, prompts: list[list[int]]) -> dict[str, Any]:
    """Greedy outputs of two batches sharing a prefix, a seeded request with forked choices (its
    copy-on-write block copies), and prompt logprobs, all through one engine."""
    engine = Engine(loaded, EngineConfig(num_blocks=96, block_size=BLOCK))
    kv, copies = engine.runner.kv, []
    copy_blocks = kv.copy_blocks

    def recorded(pairs):
        copies.extend(pairs)
        copy_blocks(pairs)

    kv.copy_blocks = recorded  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = engine.generate_batch(prompts[:1], greedy)
    second = engine.generate_batch(prompts[1:], greedy)  # reuses the shared prefix's cached blocks
    engine.add_request("forked", prompts[0][:-2], SamplingParams(max_tokens=6, temperature=0.9, seed=7, n=2,
                                                                 ignore_eos=True))
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    [scored] = engine.generate_batch([prompts[2]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    return {
        "greedy": [s.output_ids for s in first + second],
        "cached": [s.cached_len for s in second],
        "forked": sorted((d.index, t) for d in deltas for t in d.token_ids),
        "scored": scored.output_ids,
        "prompt_logprobs": scored.prompt_logprobs,
        "copies": copies,
    }


@pytest.mark.slow  # ~30 s on 2 shared cores: two processes load and run the model
def test_tensor_parallel_2_equals_1_through_the_engine(llama_folder: Path) -> None:
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(3, 40000, (22,), generator=gen).tolist()  # 5+ blocks of 4
    prompts = [shared + torch.randint(3, 40000, (n,), generator=gen).tolist() for n in (3, 9, 14)]
    expected = run_engine(load_model(llama_folder, torch.float32), prompts)
    with start_tensor_parallel(llama_folder, torch.float32, "cpu", 2) as run:
        assert isinstance(run.loaded.model, ShardedLlamaForCausalLM)
        assert run.loaded.model.layers[0].num_kv_heads == 1  # each rank holds half the KV heads
        got = run_engine(run.loaded, prompts)
    assert all(n >= 20 for n in got["cached"])  # the second batch hit the prefix cache
    assert len(got["forked"]) == 12
    assert got["copies"]  # the forked choices' shared partial block was copied on every rank
    for key in ("greedy", "cached", "forked", "scored", "copies"):
        assert got[key] == expected[key], key
    assert len(got["prompt_logprobs"]) == len(prompts[2]) - 1
    assert got["prompt_logprobs"] == pytest.approx(expected["prompt_logprobs"], abs=1e-4)
    assert not any(p.is_alive() for p in run.processes)  # the follower left when the run closed


def run_graphed(loaded: LoadedModel, batches: list[list[list[int]]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Greedy outputs of each batch through an engine whose decode steps run by bucket in `DecodeGraphs`
    (on the CPU its `_EagerReplay` stands in for the capture), and the (batch, context) buckets captured.
    Buckets 1, 2, 4: a batch of 3 replays bucket 4, a batch of 5 runs eagerly."""
    engine = Engine(loaded, EngineConfig(num_blocks=96, block_size=BLOCK))
    backend = engine.runner.backend
    assert backend is not None
    kv = loaded.model.allocate_kv(97, BLOCK)  # one more block than the pool hands out: the padding rows'
    graphs = DecodeGraphs(loaded.model, kv, 96, backend, buckets=(1, 2, 4))
    engine.runner = ModelRunner(loaded.model, kv, backend, graphs)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = [s.output_ids for batch in batches for s in engine.generate_batch(batch, greedy)]
    return outputs, sorted(graphs.graphs)


def graphed_batches() -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(5)
    return [[torch.randint(3, 40000, (n,), generator=gen).tolist() for n in sizes] for sizes in ((6, 9, 13),
                                                                                                  (5, 7, 8, 10, 11))]


def test_graphed_decode_steps_give_the_eager_tokens(llama_folder: Path) -> None:
    batches = graphed_batches()
    loaded = load_model(llama_folder, torch.float32)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = Engine(loaded, EngineConfig(num_blocks=96, block_size=BLOCK))
    expected = [s.output_ids for batch in batches for s in eager.generate_batch(batch, greedy)]
    got, captured = run_graphed(load_model(llama_folder, torch.float32), batches)
    assert got == expected
    assert captured == [(4, 256)]  # the batch of 3 in bucket 4; the batch of 5 ran eagerly


@pytest.mark.slow  # two processes load and run the model
def test_tensor_parallel_2_runs_graphed_steps_on_every_rank(llama_folder: Path) -> None:
    """The leader announces each graphed step once; the follower captures and replays the same bucket
    in its own graphs (its collectives meet the leader's), interleaved with eager steps."""
    batches = graphed_batches()
    expected, _ = run_graphed(load_model(llama_folder, torch.float32), batches)
    with start_tensor_parallel(llama_folder, torch.float32, "cpu", 2) as run:
        got, captured = run_graphed(run.loaded, batches)
    assert captured == [(4, 256)]
    assert got == expected
    assert not any(p.is_alive() for p in run.processes)


@pytest.mark.slow
def test_generate_cli_tensor_parallel_2_equals_1(llama_folder: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path / "home"))
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the quiet green woods"
    base = ["generate", "--model", str(llama_folder), "--max-tokens", "16", "--dtype", "float32"]
    single = CliRunner().invoke(cli, [*base, text])
    split = CliRunner().invoke(cli, [*base, "--tensor-parallel-size", "2", text])
    assert single.exit_code == 0, single.output
    assert split.exit_code == 0, split.output
    assert split.stdout.strip() == single.stdout.strip() != ""


def test_generate_cli_refuses_a_size_the_heads_do_not_allow(llama_folder: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(cli, ["generate", "--model", str(llama_folder), "--tensor-parallel-size", "4", "hi"])
    assert result.exit_code == 1
    assert "tensor parallel size 4 exceeds the model's 2 KV heads" in result.output
    result = CliRunner().invoke(cli, ["generate", "--model", str(llama_folder), "--tensor-parallel-size", "0", "hi"])
    assert result.exit_code == 2


BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.parametrize(("hf", "size", "quantization", "words"), [
    ({"num_attention_heads": 9, "num_key_value_heads": 3}, 2, "none", "does not divide the model's 9 query heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "none", "does not divide the model's 3 KV heads"),
    ({}, 4, "none", "exceeds the model's 2 KV heads"),
    ({"intermediate_size": 97}, 2, "none", "does not divide the model's 97 intermediate size"),
    ({"model_type": "qwen3"}, 2, "none", "model_type 'qwen3' runs with --tensor-parallel-size 1 only"),
    ({}, 2, "int8", "unquantized weights only"),
    ({}, 0, "none", "at least 1"),
])
def test_bad_sizes_are_named(hf: dict[str, Any], size: int, quantization: str, words: str) -> None:
    config = ModelConfig.from_hf({"model_type": "llama", **BASE, **hf})
    with pytest.raises(TensorParallelError, match=words):
        check_tensor_parallel(config, size, quantization)


def test_size_1_and_even_splits_pass() -> None:
    config = ModelConfig.from_hf({"model_type": "qwen2", **BASE})
    for size in (1, 2):
        check_tensor_parallel(config, size)
    check_tensor_parallel(ModelConfig.from_hf({"model_type": "qwen3", **BASE}), 1)  # any family runs unsplit


def test_the_size_comes_from_the_environment_and_the_flag_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from ops.cli import with_overrides

    monkeypatch.delenv("TOLLWAY_TENSOR_PARALLEL_SIZE", raising=False)
    assert WorkerSettings().tensor_parallel_size == 1
    monkeypatch.setenv("TOLLWAY_TENSOR_PARALLEL_SIZE", "2")  # what `tollway up` hands its workers
    settings = WorkerSettings()
    assert settings.tensor_parallel_size == 2
    assert with_overrides(settings, None, 3).tensor_parallel_size == 3
    assert with_overrides(settings, None, None).tensor_parallel_size == 2
