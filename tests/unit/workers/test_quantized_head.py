"""The LM head of a quantized model (workers/models/quantized_head.py): the int8 (or an int4 model's int4)
copy for steps of a few rows, the float head beyond; its logits within the copy's rounding, refined to the
float head's where it matters (the top of each row); greedy tokens of the engine unchanged; the float head
packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.quantized.cpu import cpu_matmul
from kernels.quantized.layout import dequantize, quantize_int4, quantize_int8
from tests.required import require_native
from workers.engine.engine import Engine, EngineConfig
from workers.models.loader import load_model
from workers.models.logits_refine import REFINED_TOP
from workers.models.packed_linear import PackedLinear, packing_kind
from workers.models.quantized_head import (
    HEAD_INT4_GROUP,
    QUANTIZED_HEAD_MAX_ROWS,
    QuantizedHead,
    head_approximates,
)
from workers.models.tiny import write_tiny_model_folder
from workers.wire.sampling import SamplingParams

PROMPTS = [[5, 9, 17, 33, 65, 3], [7, 7, 8, 100, 2, 14, 90, 4, 4, 11, 12], [40, 41, 42]]


@pytest.fixture(autouse=True)
def needs_native() -> None:
    require_native()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model_folder(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_run_the_int8_copy_and_more_rows_the_float_head(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(64, 200, bias=False)  # 200 rows: not a whole number of the kernel's tiles of 8
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 64, generator=gen) * 0.2)
    linear = linear.to(dtype)
    head = QuantizedHead(linear, dtype)
    int8_weight = dequantize(quantize_int8(linear.weight.float()))
    limit = QUANTIZED_HEAD_MAX_ROWS[dtype]
    for rows in (1, limit, limit + 1, 32):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        out = head(x)
        assert out.shape == (rows, 200) and out.dtype == dtype
        if rows <= limit:
            assert head_approximates(head, rows)
            # the int8 copy's product (its kernels' own accuracy: tests/unit/kernels/test_quantized_cpu.py)
            assert torch.equal(out, cpu_matmul(x, head.packed))
            if dtype == torch.float32:
                torch.testing.assert_close(out, F.linear(x, int8_weight), atol=1e-5, rtol=1e-5)
            assert not torch.equal(out, linear(x))  # the int8 copy really ran: it rounds the weights
        else:
            assert not head_approximates(head, rows)
            assert torch.equal(out, linear(x))
    assert head.weight is linear.weight and head.nbytes() < 200 * 64 + 200 * 8  # a byte a weight, a scale a row
    assert not head_approximates(linear, 1)


@pytest.mark.parametrize("bits", [8, 4])
def test_logits_are_refined_to_the_float_heads_at_the_top_and_within_the_copy_s_rounding_elsewhere(
        folder: Path, bits: int) -> None:
    reference = load_model(folder, torch.float32).model
    model = load_model(folder, torch.float32).model
    model.lm_head = QuantizedHead(model.lm_head, torch.float32, bits=bits)
    hidden = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 3
    got, expected = model.logits(hidden), reference.logits(hidden)
    top = expected.topk(REFINED_TOP // 4, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), expected.gather(1, top), atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # elsewhere: |error| <= sum_k |h_k| |w_nk - q_nk| (q: the copy's weight, int8 per row or int4 per group of 32)
    normed = reference.norm(hidden)
    w = reference.lm_head.weight.float()
    q = quantize_int8(w) if bits == 8 else quantize_int4(w, HEAD_INT4_GROUP)
    rounding = (w - dequantize(q)).abs()
    if bits == 8:  # at most half of each row's step, max |w_row| / 127
        assert (rounding <= w.abs().amax(dim=1, keepdim=True) / 254 + 1e-7).all()
    bound = normed.abs() @ rounding.T + 1e-5
    assert ((got - expected).abs() <= bound).all()
    assert (got - expected).abs().max() > 1e-4  # and the copy did compute them
    # the copy: under 0.3 (int8) or 0.25 (int4) of the fp32 head's bytes, with its scales (mins) and padded rows
    assert model.lm_head.nbytes() < w.numel() * 4 * (0.3 if bits == 8 else 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_engine_greedy_tokens_match_the_float_head_and_its_float_head_is_packed(folder: Path, dtype: torch.dtype,
                                                                                quantization: str) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = []
    for quantized_head in (True, False):
        loaded = load_model(folder, dtype, quantization=quantization)
        assert isinstance(loaded.model.lm_head, QuantizedHead)
        assert loaded.model.lm_head.packed.bits == int(quantization[-1])  # the head's copy is in the model's format
        if not quantized_head:
            loaded.model.lm_head = loaded.model.lm_head.float_head
        engine = Engine(loaded, EngineConfig(num_blocks=200, attention="native"))
        if quantized_head and packing_kind(dtype) is not None:
            assert isinstance(loaded.model.lm_head.float_head, PackedLinear)
        outputs.append([s.output_ids for s in engine.generate_batch(PROMPTS, params)])
        engine.check_integrity()
    assert outputs[0] == outputs[1]
