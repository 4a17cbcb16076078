"""Quantized models (workers/models/quantize.py) on the tiny model: every decoder projection swapped
for a QuantizedLinear that computes what the float model of the dequantized weights computes, on the
eager and the fused native path alike; embeddings and the float LM head untouched; clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from pydantic import ValidationError
from torch import nn

from kernels.cpu import native
from kernels.quantized.layout import dequantize, quantize_int4
from tests.required import unavailable
from workers.engine.engine import Engine, EngineConfig
from workers.models.gguf_blocks import PROJECTION_TENSORS
from workers.models.llama import FUSED_PROJECTIONS, fused_weight
from workers.models.loader import load_model, load_weights, read_model_config, read_weights
from workers.models.logits_refine import REFINED_TOP
from workers.models.packed_linear import PackedLinear, packing_kind
from workers.models.quantize import QuantizationError, quantize_floats, quantize_model
from workers.models.quantized_head import QuantizedHead
from workers.models.quantized_linear import QuantizedLinear
from workers.models.tiny import write_tiny_model_folder
from workers.paged_step import prefill_logits
from workers.settings import WorkerSettings
from workers.wire.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 33, 65, 3], [7, 7, 8, 100, 2, 14, 90, 4, 4, 11, 12]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_folder(tmp_path_factory.mktemp("tiny") / "m", "qwen2", seed=4)  # qkv bias too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_is_dequantize_then_linear_with_bias(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = quantize_int4(torch.randn(48, 64, generator=gen) * 0.1)
    bias = torch.randn(48, generator=gen)
    layer = QuantizedLinear(weight, bias, dtype)
    x = torch.randn(2, 3, 64, generator=gen).to(dtype)  # leading dims are kept
    out = layer(x)
    assert out.shape == (2, 3, 48) and out.dtype == dtype
    expected = F.linear(x.float(), dequantize(weight), bias.to(dtype).float())
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    assert layer.nbytes() < 48 * 64  # under a byte a weight, scales and zeros included


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_every_projection_is_quantized_and_computes_the_dequantized_model(folder: Path, quantization: str) -> None:
    quantized = load_model(folder, torch.float32, quantization=quantization)
    assert quantized.quantization == quantization
    reference = load_model(folder, torch.float32)
    weights = read_weights(folder)
    model = quantized.model
    for i, layer in enumerate(model.layers):
        for name in FUSED_PROJECTIONS:
            module = getattr(layer, name)
            assert isinstance(module, QuantizedLinear) and module.bits == int(quantization[-1])
            expected = quantize_floats(fused_weight(weights, i, name).float(), module.bits, name)
            with torch.no_grad():
                getattr(reference.model.layers[i], name).weight.copy_(dequantize(expected))
    head = model.lm_head  # the float head, with a copy in the model's format for steps of a few rows (native kernels)
    float_head = head.float_head if native.load() else head
    assert isinstance(head, QuantizedHead) == bool(native.load())
    assert type(float_head) is nn.Linear and float_head.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, reference.model.embed_tokens.weight)
    for prompt in PROMPTS:  # 6 rows (the copy's, its top logits refined) and 11 (the float head's)
        got, expected = prefill_logits(model, [prompt])[0], prefill_logits(reference.model, [prompt])[0]
        top = expected.topk(REFINED_TOP // 4, dim=-1).indices  # well inside the refined set, near its edge int8 may reorder
        torch.testing.assert_close(got.gather(1, top), expected.gather(1, top), atol=1e-4, rtol=1e-4)
        # the copy's other logits are off by its rounding (test_quantized_head.py bounds it exactly): int4's is coarser
        rounding = 0.1 if quantization == "int8" else 1.0
        torch.testing.assert_close(got, expected, atol=1e-4 if len(prompt) > head.max_rows else rounding, rtol=1e-4)


NEAR_TIE = 0.15
"""How far the backends' logprobs may lie apart, and so the gap under which they may swap two tokens, with
x rounded to int8 (below): measured up to 0.023 in fp32 and 0.096 in bf16 on the tiny model (AVX512-VNNI host).
Each projection alone rounded, the backends agree to 2e-6: the gap is rounding flips cascading over layers."""


def _greedy_with_logprobs(engine: Engine, params: SamplingParams) -> list[list[tuple[int, list[tuple[int, float]]]]]:
    """Each prompt's generated tokens, each with the step's top logprobs (params.logprobs of them)."""
    steps: dict[str, list[tuple[int, list[tuple[int, float]]]]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_work():
        for delta in engine.step():
            assert delta.top_logprobs is not None and len(delta.top_logprobs) == len(delta.token_ids)
            steps[delta.request_id].extend(zip(delta.token_ids, delta.top_logprobs, strict=True))
    return list(steps.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_engine_tokens_equal_on_native_and_cpu_with_projections_left_quantized(folder: Path, dtype: torch.dtype,
                                                                               activations: str) -> None:
    """With x as it is, both backends give the same greedy tokens. Decode steps that round x to int8 amplify
    the backends' float differences (attention's summation order) wherever an element of x sits at a
    rounding boundary, so there the tokens agree until the first step whose two best tokens are a near tie
    (within NEAR_TIE), and every step until then has the same top logprobs to NEAR_TIE."""
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = {}
    for backend in ("cpu", "native"):
        loaded = load_model(folder, dtype, quantization="int4", activations=activations)
        engine = Engine(loaded, EngineConfig(num_blocks=200, attention=backend))
        assert engine.runner.backend == backend
        layer = loaded.model.layers[0]
        assert all(isinstance(getattr(layer, name), QuantizedLinear) for name in FUSED_PROJECTIONS)
        packed = backend == "native" and packing_kind(dtype) is not None  # the engine packs for native only
        assert isinstance(loaded.model.lm_head, QuantizedHead)  # its float head is packed like a linear
        assert isinstance(loaded.model.lm_head.float_head, PackedLinear) == packed
        outputs[backend] = _greedy_with_logprobs(engine, params)
        engine.check_integrity()
        assert engine.info()["quantization"] == "int4" and engine.info()["quantized_activations"] == activations
    for cpu, fused in zip(outputs["cpu"], outputs["native"], strict=True):
        assert len(cpu) == len(fused) == params.max_tokens
        if activations == "float":
            assert [token for token, _ in fused] == [token for token, _ in cpu]
            continue
        for (token, top), (fused_token, fused_top) in zip(cpu, fused, strict=True):
            (best, best_logprob), (_, second_logprob) = top
            assert best == token
            if fused_token != token:  # the backends part here, at a near tie, and follow different texts after
                assert best_logprob - second_logprob < NEAR_TIE and fused_token == top[1][0]
                break
            torch.testing.assert_close([lp for _, lp in fused_top], [lp for _, lp in top], atol=NEAR_TIE, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_decode_steps_round_activations_to_int8_and_prefill_steps_do_not(folder: Path, dtype: torch.dtype,
                                                                         activations: str) -> None:
    """The engine's decode steps run the int8-activation kernels (AVX512-VNNI's or AVX2's), its prefill the
    float ones (prompt logprobs and prefill keep x as it is); with activations="float" no step runs them."""
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    loaded = load_model(folder, dtype, quantization="int4", activations=activations)
    engine = Engine(loaded, EngineConfig(num_blocks=200, attention="native"))
    engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    ops_per_step = []
    while engine.has_work():
        with torch.profiler.profile() as profile:
            engine.step()
        ops_per_step.append({event.name for event in profile.events()})
    assert len(ops_per_step) == 3  # the prompt's one prefill step (11 rows), then two decode steps
    assert "tollway_cpu::int4_matmul" in ops_per_step[0] and "tollway_cpu::int4_matmul_q8" not in ops_per_step[0]
    assert all(("tollway_cpu::int4_matmul_q8" in names) == (activations == "int8") for names in ops_per_step[1:])


def test_unknown_quantization_is_refused(folder: Path) -> None:
    with pytest.raises(QuantizationError, match="unknown quantization 'int3'; choose one of none, int8, int4"):
        load_model(folder, torch.float32, quantization="int3")
    with pytest.raises(ValidationError, match="int8"):
        WorkerSettings(quantization="int3")  # type: ignore[arg-type]
    assert WorkerSettings().quantization == "none"


def test_int4_needs_in_features_in_whole_groups(tmp_path: Path) -> None:
    odd = write_tiny_model_folder(tmp_path / "m", "llama", hidden_size=48, head_dim=12)
    with pytest.raises(QuantizationError, match="layer 0 qkv_proj: in_features 48 is not a multiple of the int4 "
                                                "group size 32"):
        load_model(odd, torch.float32, quantization="int4")
    assert load_model(odd, torch.float32, quantization="int8").quantization == "int8"  # per channel: any size


def _as_if_converted_from_q4_1(folder: Path, gguf_path: Path) -> dict[str, torch.Tensor]:
    """Write the tiny model's projections into a llama GGUF as Q4_1 (q/k rows permuted as llama.cpp
    does) and return its weights as the conversion would leave them: the blocks' values, unpermuted."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = read_model_config(folder)
    weights = read_weights(folder)
    heads = {"attn_q": config.num_q_heads, "attn_k": config.num_kv_heads}
    reverse = LlamaTensorProcessor(config={"num_attention_heads": config.num_q_heads,
                                           "num_key_value_heads": config.num_kv_heads})
    writer = GGUFWriter(str(gguf_path), "llama")
    for i in range(config.num_layers):
        for projection, parts in PROJECTION_TENSORS.items():
            for gguf_name, hf_name in zip(parts, FUSED_PROJECTIONS[projection], strict=True):
                key = f"model.layers.{i}.{hf_name}.weight"
                w = weights[key].numpy()
                if gguf_name in heads:
                    n = heads[gguf_name]
                    w = w.reshape(n, 2, w.shape[0] // n // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
                blocks = gguf_quantize(w, GGMLQuantizationType.Q4_1)
                writer.add_tensor(f"blk.{i}.{gguf_name}.weight", blocks, raw_dtype=GGMLQuantizationType.Q4_1)
                values = gguf_dequantize(blocks, GGMLQuantizationType.Q4_1)
                if gguf_name in heads:
                    values = reverse._reverse_permute_weights(values, config.num_q_heads, heads[gguf_name])
                weights[key] = torch.from_numpy(np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def test_int4_takes_a_gguf_s_blocks_where_they_are_the_folder_s_weights(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = write_tiny_model_folder(tmp_path / "m", "llama", seed=6)
    gguf_path = tmp_path / "m.gguf"
    weights = _as_if_converted_from_q4_1(folder, gguf_path)
    config = read_model_config(folder)

    model = load_weights(folder, config, torch.float32, "cpu", weights)
    summary = quantize_model(model, weights, "int4", gguf_path)
    assert (summary.from_gguf, summary.from_floats) == (4 * config.num_layers, 0)
    float_model = load_weights(folder, config, torch.float32, "cpu", weights)
    # The blocks are the float model's weights: the int4 projections compute it (to summation order).
    # (The int8 copy of the head, for steps of a few rows, is another matter: test_quantized_head.py.)
    if isinstance(model.lm_head, QuantizedHead):
        model.lm_head = model.lm_head.float_head
    for prompt in PROMPTS:
        torch.testing.assert_close(prefill_logits(model, [prompt]), prefill_logits(float_model, [prompt]),
                                   atol=1e-4, rtol=1e-4)

    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"] * 1.01
    edited = quantize_model(load_weights(folder, config, torch.float32, "cpu", weights), weights, "int4", gguf_path)
    assert (edited.from_gguf, edited.from_floats) == (4 * config.num_layers - 1, 1)
    assert "layer 1 down_proj differs from the folder's weights" in caplog.text
    as_int8 = quantize_model(load_weights(folder, config, torch.float32, "cpu", weights), weights, "int8", gguf_path)
    assert (as_int8.from_gguf, as_int8.from_floats) == (0, 4 * config.num_layers)  # Q4 blocks are not int8's
