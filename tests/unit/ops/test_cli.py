"""The CLI surface: commands listed, generate on a tiny model folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ops.cli import cli
from workers.models.tiny import write_tiny_model_folder


def test_help_lists_the_design_commands() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for command in ("up", "gateway", "worker", "generate", "tenants", "keys", "usage", "batch"):
        assert f"  {command} " in result.output


def test_a_worker_binds_the_loopback_unless_told_otherwise() -> None:
    result = CliRunner().invoke(cli, ["worker", "--help"])
    assert result.exit_code == 0 and "[default: 127.0.0.1]" in result.output


def test_batch_lists_its_commands() -> None:
    result = CliRunner().invoke(cli, ["batch", "--help"])
    assert result.exit_code == 0
    for command in ("submit", "list", "status", "cancel", "download"):
        assert f"  {command} " in result.output


def test_generate_on_a_local_folder_prints_only_the_completion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_tiny_model_folder(tmp_path / "tiny")
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path / "home"))
    args = ["generate", "--model", str(folder), "--max-tokens", "5", "--dtype", "float32", "w1 w2 w3"]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    words = first.stdout.split()
    assert 1 <= len(words) <= 5 and all(w.startswith("w") or w in ("user", "assistant", "system") for w in words)
    assert CliRunner().invoke(cli, args).stdout == first.stdout  # greedy is deterministic


def test_generate_with_seed_is_reproducible(tmp_path: Path) -> None:
    folder = write_tiny_model_folder(tmp_path / "tiny")
    args = ["generate", "--model", str(folder), "--chat", "--temperature", "1.5", "--seed", "7", "--max-tokens", "8", "w1"]
    outputs = {CliRunner().invoke(cli, args).stdout for _ in range(2)}
    assert len(outputs) == 1


def test_generate_rejects_a_prompt_longer_than_the_context(tmp_path: Path) -> None:
    folder = write_tiny_model_folder(tmp_path / "tiny", max_position_embeddings=16)
    result = CliRunner().invoke(cli, ["generate", "--model", str(folder), "--max-tokens", "10", "w1 " * 10])
    assert result.exit_code == 2
    assert "exceeds the model's context of 16 tokens" in result.output


def test_generate_quantized_and_its_errors(tmp_path: Path) -> None:
    folder = write_tiny_model_folder(tmp_path / "tiny")
    args = ["generate", "--model", str(folder), "--max-tokens", "5", "--dtype", "float32", "w1 w2 w3"]
    result = CliRunner().invoke(cli, [*args, "--quantization", "int4"])
    assert result.exit_code == 0, result.output
    assert 1 <= len(result.stdout.split()) <= 5
    assert CliRunner().invoke(cli, [*args, "--quantization", "int3"]).exit_code == 2  # not a choice
    from_env = CliRunner().invoke(cli, args, env={"TOLLWAY_QUANTIZATION": "int3"})
    assert from_env.exit_code == 2 and "TOLLWAY_QUANTIZATION: Input should be 'none', 'int8' or 'int4'" in from_env.output
    odd = write_tiny_model_folder(tmp_path / "odd", hidden_size=48, head_dim=12)
    refused = CliRunner().invoke(cli, ["generate", "--model", str(odd), "--quantization", "int4", "w1"])
    assert refused.exit_code == 1
    assert "in_features 48 is not a multiple of the int4 group size 32" in refused.output


def test_the_quantization_choices_are_the_settings() -> None:
    from typing import get_args

    from workers.models.quantize import QUANTIZATIONS
    from workers.settings import WorkerSettings

    assert get_args(WorkerSettings.model_fields["quantization"].annotation) == QUANTIZATIONS
    for command in ("up", "worker", "generate"):
        result = CliRunner().invoke(cli, [command, "--help"])
        assert "--quantization [none|int8|int4]" in result.output
