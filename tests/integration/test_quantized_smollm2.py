"""Quantized loads of the default model: int4 reads every projection from the GGUF's own Q4_1 blocks
(exactly the float folder's weights, which the conversion made from them), so its greedy tokens are
the float model's; int8, quantized afresh per channel from those floats, stays close and fluent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.engine.engine import Engine, EngineConfig
from workers.models.assets import source_gguf
from workers.models.loader import LoadedModel, load_model, load_weights, read_model_config, read_weights
from workers.models.quantize import quantize_model
from workers.models.quantized_linear import QuantizedLinear
from workers.models.tokenizer import tokenizer_payload
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

QUESTIONS = ["How do I create an API key?", "What does the prefix cache do?", "Where are usage reports?",
             "Write one sentence about the sea."]
MAX_TOKENS = 24


def test_int4_reads_every_projection_from_the_q4_1_blocks_exactly(smollm2_folder: Path) -> None:
    gguf = source_gguf(smollm2_folder)
    assert gguf is not None and gguf.name.endswith(".Q4_1.gguf")
    config = read_model_config(smollm2_folder)
    weights = read_weights(smollm2_folder)
    model = load_weights(smollm2_folder, config, torch.float32, "cpu", weights)
    summary = quantize_model(model, weights, "int4", gguf)  # a block is taken only where it IS the float weight
    assert (summary.from_gguf, summary.from_floats) == (4 * config.num_layers, 0)
    int8 = quantize_model(load_weights(smollm2_folder, config, torch.float32, "cpu", weights), weights, "int8", gguf)
    assert (int8.from_gguf, int8.from_floats) == (0, 4 * config.num_layers)  # Q4_1 blocks: int8 from the floats


def _greedy(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(loaded, EngineConfig(num_blocks=200))
    outputs = engine.generate_batch(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    engine.check_integrity()
    return [s.output_ids for s in outputs]


@pytest.fixture(scope="module")
def prompts(smollm2_folder: Path) -> list[list[int]]:
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(smollm2_folder))
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_greedy_tokens_against_the_float_model(smollm2_folder: Path, prompts: list[list[int]],
                                                         dtype: torch.dtype) -> None:
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(smollm2_folder))
    reference = _greedy(load_model(smollm2_folder, dtype), prompts)
    int4 = load_model(smollm2_folder, dtype, quantization="int4")
    assert isinstance(int4.model.layers[0].qkv_proj, QuantizedLinear)
    int4_tokens = _greedy(int4, prompts)
    int8_tokens = _greedy(load_model(smollm2_folder, dtype, quantization="int8"), prompts)
    if dtype == torch.float32:
        assert int4_tokens == reference  # the same weights; only the summation order differs
    else:
        # bf16 rounds the Q4_1 scales and zeros to bf16 (relative 2^-9) where the float model rounds
        # each weight: a near-tie can flip late in a reply, so the first tokens are asked for.
        assert all(_common_prefix(a, b) >= 8 for a, b in zip(int4_tokens, reference, strict=True))
    agreement = sum(_common_prefix(a, b) for a, b in zip(int8_tokens, reference, strict=True))
    assert agreement >= 0.5 * sum(len(r) for r in reference)
    for tokens in int8_tokens + int4_tokens:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(text.split()) >= 5 and text.isprintable()
