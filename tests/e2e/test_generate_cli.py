"""`tollway generate` as a real process against transformers' greedy generate."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.required import unavailable

pytestmark = pytest.mark.slow

PROMPT = "Write a haiku about caching."


def tollway_executable() -> str:
    found = shutil.which("tollway", path=str(Path(sys.executable).parent))
    if found is None:
        unavailable("the tollway console script is not installed in this environment")
    return found


def test_chat_greedy_fp32_prints_what_transformers_decodes(smollm2_folder: Path, model_home: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=48, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    result = subprocess.run(
        [tollway_executable(), "generate", "--chat", "--temperature", "0", "--dtype", "float32",
         "--max-tokens", "48", PROMPT],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TOLLWAY_HOME": str(model_home)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert expected  # the model said something


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [tollway_executable(), "generate", "--model", "no-such-model", "hi"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TOLLWAY_HOME": str(tmp_path)},
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert "unknown model 'no-such-model'" in result.stderr
    assert "smollm2-135m-instruct" in result.stderr


def test_an_empty_prompt_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [tollway_executable(), "generate", ""],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TOLLWAY_HOME": str(tmp_path)},
    )
    assert result.returncode == 2
    assert "PROMPT is empty" in result.stderr and "Traceback" not in result.stderr
