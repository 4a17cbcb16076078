"""`tollway eval-ppl` on the default model and the repo's fixed test text (tests/data), against
transformers on the same windows; and the perplexity bounds of the quantized weight formats."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from kernels.quantized.cpu import decode_step
from ops.cli import cli
from ops.perplexity import plan_windows
from tests.unit.ops.test_eval_ppl import reference_nll
from workers.models.tokenizer import tokenizer_payload
from workers.wire.tokenizer import TextTokenizer

TEXT = Path(__file__).resolve().parents[1] / "data" / "declaration_and_lincoln.txt"
WINDOW, STRIDE = 1024, 768  # 4 windows: 3,663 tokens computed for 2,894 scored


@pytest.fixture(scope="module")
def token_ids(smollm2_folder: Path) -> list[int]:
    return TextTokenizer.from_payload(tokenizer_payload(smollm2_folder)).encode(TEXT.read_text(encoding="utf-8"))


def eval_ppl(model_home: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> dict[str, Any]:
    monkeypatch.setenv("TOLLWAY_HOME", str(model_home))
    monkeypatch.setenv("TOLLWAY_KV_CACHE_MB", "512")  # 11k tokens of fp32 KV: eight 1024-token windows at once
    result = CliRunner().invoke(cli, ["eval-ppl", "--dtype", "float32", "--json", *args, str(TEXT)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_test_text_is_a_few_thousand_tokens(token_ids: list[int]) -> None:
    assert 2000 <= len(token_ids) <= 4000


@pytest.mark.slow
def test_perplexity_equals_transformers_on_the_same_windows(smollm2_folder: Path, model_home: Path,
                                                            token_ids: list[int],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    figures = eval_ppl(model_home, monkeypatch, "--window", str(WINDOW), "--stride", str(STRIDE))
    plan = plan_windows(len(token_ids), WINDOW, STRIDE)
    assert len(plan) >= 4 and (figures["tokens"], figures["windows"]) == (len(token_ids) - 1, len(plan))
    theirs = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    nll, count = reference_nll(theirs, token_ids, plan)
    assert math.isfinite(figures["perplexity"]) and figures["perplexity"] > 1
    assert figures["mean_nll"] == pytest.approx(nll / count, abs=2e-4)
    assert figures["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(("quantization", "bound"), [("int8", 1.02), ("int4", 1.10)])
def test_quantized_perplexity_stays_near_the_unquantized(model_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                        quantization: str, bound: float) -> None:
    base = eval_ppl(model_home, monkeypatch, "--quantization", "none")  # one window: the context holds the text
    quantized = eval_ppl(model_home, monkeypatch, "--quantization", quantization)
    assert quantized["tokens"] == base["tokens"] and quantized["quantization"] == quantization
    assert math.isfinite(quantized["perplexity"])
    assert quantized["perplexity"] <= bound * base["perplexity"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_perplexity_in_decode_sized_steps_stays_near_the_unquantized(
        model_home: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """Steps of 8 rows run the quantized row kernels (below their dequantize thresholds), as decode steps
    do: with x rounded to int8 per block (kernels/cpu/native/quantized_q8.cpp: AVX512-VNNI or AVX2), which
    the engine allows in decode steps only, so here every step is taken for one (`decode_step`).
    The bounds hold there too. (The test above runs whole-window steps: dequantize and one GEMM.)"""
    monkeypatch.setenv("TOLLWAY_MAX_BATCH_TOKENS", "8")
    with decode_step():
        figures = {q: eval_ppl(model_home, monkeypatch, "--quantization", q, "--dtype", dtype)
                   for q in ("none", "int8", "int4")}
    assert {f["tokens"] for f in figures.values()} == {figures["none"]["tokens"]}
    assert figures["int8"]["perplexity"] <= 1.02 * figures["none"]["perplexity"]
    assert figures["int4"]["perplexity"] <= 1.10 * figures["none"]["perplexity"]
    assert figures["int4"]["perplexity"] != figures["none"]["perplexity"]  # the row kernels did run


@pytest.mark.slow
def test_float16_kv_cache_perplexity_stays_near_the_fp32_cache(model_home: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """TOLLWAY_KV_CACHE_DTYPE=float16 under the fp32 model (measured +0.01%; bfloat16 the same, RESULTS.md)."""
    base = eval_ppl(model_home, monkeypatch)
    monkeypatch.setenv("TOLLWAY_KV_CACHE_DTYPE", "float16")
    narrow = eval_ppl(model_home, monkeypatch)
    assert narrow["tokens"] == base["tokens"] and math.isfinite(narrow["perplexity"])
    assert narrow["perplexity"] != base["perplexity"]  # the cache did round the K/V
    assert narrow["perplexity"] <= 1.005 * base["perplexity"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_kv_cache_perplexity_stays_near_the_model_dtype_cache(model_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   dtype: str) -> None:
    """TOLLWAY_KV_CACHE_DTYPE=int8 (codes + an fp16 scale per 16 values, kernels/kv_int8.py): measured +0.21% under
    fp32 and -0.09% under bf16 (RESULTS.md; a scale per 64-value row gave +0.43% and +0.13%); the bound is 1%,
    half the int8 weights' 2%."""
    base = eval_ppl(model_home, monkeypatch, "--dtype", dtype)
    monkeypatch.setenv("TOLLWAY_KV_CACHE_DTYPE", "int8")
    quantized = eval_ppl(model_home, monkeypatch, "--dtype", dtype)
    assert quantized["tokens"] == base["tokens"] and math.isfinite(quantized["perplexity"])
    assert quantized["perplexity"] != base["perplexity"]  # the cache did quantize the K/V
    assert quantized["perplexity"] <= 1.01 * base["perplexity"]
