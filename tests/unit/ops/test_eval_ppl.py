"""`tollway eval-ppl` on a tiny model folder against transformers on the same windows, the window
plan, and the command's refusals. (The default model on the repo's test text: tests/integration.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from ops.cli import cli
from ops.perplexity import Window, plan_windows
from workers.models.tiny import write_tiny_model_folder
from workers.models.tokenizer import tokenizer_payload
from workers.wire.tokenizer import TextTokenizer


def reference_nll(model, token_ids: list[int], windows: list[Window]) -> tuple[float, int]:
    """Summed NLL and count of the tokens each window scores, by a teacher-forced forward."""
    nll, count = 0.0, 0
    for w in windows:
        with torch.no_grad():
            logprobs = model(torch.tensor([token_ids[w.start : w.end]])).logits[0].log_softmax(dim=-1).double()
        positions = torch.arange(w.scored_from - w.start - 1, w.num_tokens - 1)
        nll -= logprobs[positions, torch.tensor(token_ids[w.scored_from : w.end])].sum().item()
        count += w.end - w.scored_from
    return nll, count


def use_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOLLWAY_KV_CACHE_MB", "16")  # the tiny model's KV: plenty, without 2 GiB of zeros


def test_windows_score_every_token_after_the_first_once() -> None:
    assert plan_windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    assert plan_windows(10, 16, 8) == [Window(0, 10, 1)]  # shorter than a window: one window
    assert plan_windows(7, 4, 3) == [Window(0, 4, 1), Window(3, 7, 4)]
    for n, window, stride in ((2, 2, 1), (1000, 64, 48), (1000, 64, 1), (97, 10, 9)):
        plan = plan_windows(n, window, stride)
        scored = [t for w in plan for t in range(w.scored_from, w.end)]
        assert scored == list(range(1, n))
        assert all(w.num_tokens <= window and w.start < w.scored_from for w in plan)
        assert all(w.scored_from - w.start >= window - stride for w in plan[1:])  # the context each keeps


@pytest.mark.parametrize(("args", "message"), [((1, 4, 2), "at least 2 tokens"), ((10, 1, 1), "window"),
                                                ((10, 4, 4), "stride"), ((10, 4, 0), "stride")])
def test_impossible_plans_are_refused(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_windows(*args)


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int]]:
    """(a tiny model folder, a text file of 150 of its words, the text's token ids)."""
    root = tmp_path_factory.mktemp("ppl")
    folder = write_tiny_model_folder(root / "tiny", seed=4)
    words = torch.randint(0, 125, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    text = root / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in words))
    token_ids = TextTokenizer.from_payload(tokenizer_payload(folder)).encode(text.read_text())
    return folder, text, token_ids


def test_perplexity_equals_transformers_on_the_same_windows(tiny_text, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder, text, token_ids = tiny_text
    use_home(monkeypatch, tmp_path)
    monkeypatch.setenv("TOLLWAY_MAX_BATCH_TOKENS", "16")  # windows of 40 tokens in chunked prefills
    result = CliRunner().invoke(cli, ["eval-ppl", "--model", str(folder), "--dtype", "float32", "--window", "40",
                                      "--stride", "25", "--json", str(text)])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    plan = plan_windows(len(token_ids), 40, 25)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    nll, count = reference_nll(theirs, token_ids, plan)
    assert (figures["tokens"], figures["windows"], figures["window"], figures["stride"]) == (
        len(token_ids) - 1, len(plan), 40, 25) and count == len(token_ids) - 1
    assert figures["mean_nll"] == pytest.approx(nll / count, abs=1e-4)
    assert figures["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_the_table_names_the_figures(tiny_text, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, text, token_ids = tiny_text
    use_home(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli, ["eval-ppl", "--model", str(folder), "--dtype", "float32", str(text)])
    assert result.exit_code == 0, result.output
    lines = dict(line.split(maxsplit=1) for line in result.stdout.splitlines() if line.strip())
    assert lines["tokens"] == f"{len(token_ids) - 1} scored"
    assert lines["windows"] == "1 (window 512, stride 256 tokens)"  # the tiny model's context, half of it
    assert math.isfinite(float(lines["perplexity"])) and float(lines["perplexity"]) > 1


@pytest.mark.parametrize(("args", "message"), [
    (["--window", "600"], "exceeds the model's context of 512"),
    (["--window", "40", "--stride", "40"], "stride must be at least 1 and below the window"),
])
def test_bad_windows_are_usage_errors(tiny_text, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      args: list[str], message: str) -> None:
    folder, text, _ = tiny_text
    use_home(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli, ["eval-ppl", "--model", str(folder), *args, str(text)])
    assert result.exit_code == 2 and message in result.output


def test_a_text_of_one_token_is_a_usage_error(tiny_text, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _, _ = tiny_text
    use_home(monkeypatch, tmp_path)
    (tmp_path / "one.txt").write_text("w5")
    result = CliRunner().invoke(cli, ["eval-ppl", "--model", str(folder), str(tmp_path / "one.txt")])
    assert result.exit_code == 2 and "at least 2 tokens" in result.output


def test_quantization_is_passed_to_the_loader_and_reported(tiny_text, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    folder, text, _ = tiny_text
    use_home(monkeypatch, tmp_path)
    args = ["eval-ppl", "--model", str(folder), "--dtype", "float32", "--json", str(text)]
    plain = json.loads(CliRunner().invoke(cli, [*args, "--quantization", "none"]).stdout)
    result = CliRunner().invoke(cli, [*args, "--quantization", "int8"])
    assert result.exit_code == 0, result.output
    int8 = json.loads(result.stdout)
    assert int8["quantization"] == "int8" and int8["tokens"] == plain["tokens"]
    assert int8["perplexity"] != plain["perplexity"]  # the weights really changed
    assert abs(int8["perplexity"] / plain["perplexity"] - 1) < 0.05
    result = CliRunner().invoke(cli, ["eval-ppl", "--model", str(folder), "--quantization", "int3", str(text)])
    assert result.exit_code == 2 and "int3" in result.output  # not a choice


def test_help_lists_eval_ppl() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0 and "  eval-ppl " in result.output
