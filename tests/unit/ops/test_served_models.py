"""`tollway up --model A --model B`: the specs' served names, the workers' layout (ports, models,
threads), the children's argv, and the readiness URL that waits for every model."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ops import supervisor
from ops.cli import cli
from ops.served_models import (
    ModelSpecError,
    ServedModel,
    check_model_sources,
    parse_model_spec,
    parse_model_specs,
    threads_per_worker,
    worker_layout,
)
from ops.supervisor import plan_children, ready_url
from workers.models.assets import ModelFolderError, ModelNotFoundError


def test_a_name_is_served_as_itself_and_a_path_as_its_folder(tmp_path: Path) -> None:
    assert parse_model_spec("smollm2-135m-instruct") == ServedModel("smollm2-135m-instruct", "smollm2-135m-instruct")
    folder = tmp_path / "tiny-qwen3"
    folder.mkdir()
    assert parse_model_spec(str(folder)) == ServedModel("tiny-qwen3", str(folder))
    assert parse_model_spec(f"{tmp_path}/models/phi-3.gguf") == ServedModel("phi-3", f"{tmp_path}/models/phi-3.gguf")


def test_relative_paths_become_absolute_for_the_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    assert parse_model_spec("./here") == ServedModel("here", str(tmp_path / "here"))
    assert parse_model_spec("here") == ServedModel("here", str(tmp_path / "here"))  # an existing folder


def test_name_equals_source_names_the_model(tmp_path: Path) -> None:
    assert parse_model_spec(f"tiny={tmp_path}/x y") == ServedModel("tiny", f"{tmp_path}/x y")
    assert parse_model_spec("chat:v2=smollm2-135m-instruct") == ServedModel("chat:v2", "smollm2-135m-instruct")
    # an '=' after a '/' is part of a path, not NAME=SOURCE (and then the folder name is no model id)
    assert parse_model_spec(f"t={tmp_path}/a=b") == ServedModel("t", f"{tmp_path}/a=b")
    with pytest.raises(ModelSpecError, match="give one as NAME="):
        parse_model_spec(f"{tmp_path}/a=b")
    with pytest.raises(ModelSpecError, match="not a valid model name"):
        parse_model_spec("my model=smollm2-135m-instruct")
    with pytest.raises(ModelSpecError, match="nothing to serve"):
        parse_model_spec("tiny=")


def test_a_folder_name_that_cannot_be_a_model_id_asks_for_a_name(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="give one as NAME="):
        parse_model_spec(str(tmp_path / "my model"))
    with pytest.raises(ModelSpecError):
        parse_model_spec("")
    with pytest.raises(ModelSpecError):
        parse_model_spec("x" * 201)


def test_two_specs_with_one_served_name_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="given twice"):
        parse_model_specs(["smollm2-135m-instruct", "smollm2-135m-instruct"])
    with pytest.raises(ModelSpecError, match="both"):
        parse_model_specs([f"{tmp_path}/a/tiny", f"{tmp_path}/b/tiny"])
    named = parse_model_specs([f"{tmp_path}/a/tiny", f"tiny-b={tmp_path}/b/tiny"])
    assert [m.name for m in named] == ["tiny", "tiny-b"]


def test_layout_gives_each_model_its_workers_on_consecutive_ports() -> None:
    a, b = ServedModel("a", "a"), ServedModel("b", "/m/b")
    slots = worker_layout([a, b], 2, 8100)
    assert [(s.index, s.port, s.model) for s in slots] == [(0, 8100, a), (1, 8101, a), (2, 8102, b), (3, 8103, b)]
    assert [(s.port, s.model) for s in worker_layout([], 2, 9000)] == [(9000, None), (9001, None)]


def test_the_cores_are_shared_equally_among_every_worker() -> None:
    assert threads_per_worker(2, 16) == 8
    assert threads_per_worker(3, 16) == 5
    assert threads_per_worker(4, 2) == 1  # more workers than cores: one thread each


def test_up_runs_workers_per_model_behind_one_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOLLWAY_NUM_THREADS", raising=False)
    monkeypatch.setattr(supervisor.os, "cpu_count", lambda: 8)
    models = [ServedModel("smollm2-135m-instruct", "smollm2-135m-instruct"), ServedModel("tiny", "/m/tiny-qwen3")]
    children = {c.name: c for c in plan_children(tmp_path, 8000, 2, 8100, "s", models=models)}
    assert set(children) == {"worker-0", "worker-1", "worker-2", "worker-3", "gateway", "batch-worker"}
    assert children["worker-1"].argv[-4:] == ["--port", "8101", "--model", "smollm2-135m-instruct"]
    assert children["worker-2"].argv[-6:] == ["--port", "8102", "--model", "/m/tiny-qwen3", "--served-name", "tiny"]
    assert {children[f"worker-{i}"].env["TOLLWAY_NUM_THREADS"] for i in range(4)} == {"2"}  # 8 cores / 4 workers
    assert children["gateway"].env["TOLLWAY_WORKER_URLS"] == ",".join(f"http://127.0.0.1:{p}" for p in range(8100, 8104))
    assert children["worker-3"].log_path == tmp_path / "logs" / "worker-3.log"


def test_up_without_model_starts_the_default_model_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_NUM_THREADS", "3")
    children = {c.name: c for c in plan_children(tmp_path, 8000, 2, 8100, "s")}
    assert children["worker-0"].argv[-3:] == ["worker", "--port", "8100"]  # TOLLWAY_MODEL, read by the worker
    assert children["worker-1"].env["TOLLWAY_NUM_THREADS"] == "3"  # an explicit setting wins over the share


def test_readiness_waits_for_every_named_model() -> None:
    assert ready_url(8000) == "http://127.0.0.1:8000/readyz"
    assert ready_url(8000, [ServedModel("a", "a"), ServedModel("b:1", "/x")]) == \
        "http://127.0.0.1:8000/readyz?model=a&model=b%3A1"


def test_a_bad_model_spec_is_a_usage_error_before_anything_starts(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path))
    result = CliRunner().invoke(cli, ["up", "--model", "a", "--model", "a"])
    assert result.exit_code == 2 and "given twice" in result.output
    assert not (tmp_path / "tollway.db").exists()  # refused before the database was touched
    result = CliRunner().invoke(cli, ["worker", "--served-name", "no spaces please"])
    assert result.exit_code == 2 and "--served-name" in result.output


def test_a_model_no_worker_could_load_is_refused_before_anything_starts(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).write_text("{}")
    check_model_sources([ServedModel("tiny", str(folder))], tmp_path)  # a model folder: fine
    (tmp_path / "models" / "mine").mkdir(parents=True)
    (tmp_path / "models" / "mine" / "config.json").write_text("{}")
    check_model_sources([ServedModel("mine", "mine")], tmp_path)  # a folder under $TOLLWAY_HOME/models
    with pytest.raises(ModelNotFoundError, match="unknown model 'gpt-9'; available: mine, smollm2-135m-instruct"):
        check_model_sources([ServedModel("gpt-9", "gpt-9")], tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelFolderError, match=r"missing tokenizer\.json"):
        check_model_sources([ServedModel("tiny", str(folder))], tmp_path)
    with pytest.raises(ModelFolderError, match="is not a file"):
        check_model_sources([ServedModel("x", str(tmp_path / "x.gguf"))], tmp_path)


def test_up_with_an_unknown_model_exits_1_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path))
    result = CliRunner().invoke(cli, ["up", "--model", f"{tmp_path}/nowhere", "--model", "smollm2-135m-instruct"])
    assert result.exit_code == 1 and f"{tmp_path}/nowhere is not a folder" in result.output
    assert not (tmp_path / "tollway.db").exists()
