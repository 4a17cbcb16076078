"""Model name resolution, the one-time atomic conversion, and clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from workers.models import assets, convert
from workers.models.assets import ModelFolderError, ModelNotFoundError, resolve_model_folder
from workers.models.loader import load_model
from workers.models.tiny import write_tiny_model_folder


def test_unknown_name_lists_what_is_available(tmp_path: Path) -> None:
    write_tiny_model_folder(tmp_path / "models" / "my-tiny")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_folder("gpt-17", tmp_path)
    message = str(err.value)
    assert "'gpt-17'" in message
    assert "smollm2-135m-instruct" in message
    assert "my-tiny" in message


def test_local_folder_loads_by_path_and_by_name(tmp_path: Path) -> None:
    folder = write_tiny_model_folder(tmp_path / "models" / "tiny")
    assert resolve_model_folder(str(folder), tmp_path) == folder
    assert resolve_model_folder("tiny", tmp_path) == folder
    assert load_model(folder, torch.float32).model.config.num_layers == 2


@pytest.mark.parametrize("broken", ["no-config", "no-weights", "bad-type", "wrong-shapes"])
def test_broken_folder_is_a_clear_error(tmp_path: Path, broken: str) -> None:
    folder = write_tiny_model_folder(tmp_path / "m")
    if broken == "no-config":
        (folder / "config.json").unlink()
        expected = "missing config.json"
    elif broken == "no-weights":
        (folder / "model.safetensors").unlink()
        expected = "missing *.safetensors"
    elif broken == "bad-type":
        config = folder / "config.json"
        config.write_text(config.read_text().replace('"model_type": "llama"', '"model_type": "gpt2"'))
        expected = "model_type 'gpt2' is not supported"
    else:
        write_tiny_model_folder(folder, hidden_size=32)
        (folder / "config.json").write_text((folder / "config.json").read_text().replace('"hidden_size": 32', '"hidden_size": 64'))
        expected = "weights do not match config.json"
    with pytest.raises(ModelFolderError, match=re.escape(expected)):
        load_model(resolve_model_folder(str(folder), tmp_path), torch.float32)


def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    gguf = tmp_path / "pkg" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    source = assets.PackagedGGUF(package="nope", filename="model.gguf", install_hint="")
    monkeypatch.setattr(source.__class__, "locate", lambda self: gguf)
    monkeypatch.setitem(assets.BUILTIN_MODELS, "fake-model", source)
    return gguf


def test_builtin_converts_once_then_reuses_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gguf(tmp_path, monkeypatch)
    calls: list[Path] = []

    def write(gguf_path: Path, out: Path) -> None:
        calls.append(gguf_path)
        write_tiny_model_folder(out)

    monkeypatch.setattr(convert, "write_converted_folder", write)
    first = resolve_model_folder("fake-model", tmp_path / "home")
    second = resolve_model_folder("fake-model", tmp_path / "home")
    assert first == second == tmp_path / "home" / "models" / "fake-model"
    assert len(calls) == 1
    assert load_model(first, torch.float32).tokenizer.encode("w1 w2") == [4, 5]


def test_crash_mid_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gguf(tmp_path, monkeypatch)

    def crash(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "write_converted_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_folder("fake-model", tmp_path / "home")
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_missing_model_package_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = assets.PackagedGGUF(package="tollway_no_such_pkg", filename="x.gguf", install_hint="pip install x")
    monkeypatch.setitem(assets.BUILTIN_MODELS, "needs-pkg", source)
    with pytest.raises(ModelNotFoundError, match="pip install x"):
        resolve_model_folder("needs-pkg", tmp_path)


def test_a_converted_folder_records_its_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = fake_gguf(tmp_path, monkeypatch)
    monkeypatch.setattr(convert, "write_converted_folder", lambda gguf_path, out: write_tiny_model_folder(out))
    folder = resolve_model_folder("fake-model", tmp_path / "home")
    assert assets.source_gguf(folder) == gguf.resolve()
    assert assets.source_gguf(write_tiny_model_folder(tmp_path / "plain")) is None


def test_a_gguf_path_converts_once_into_a_folder_named_by_its_stem(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def write(gguf_path: Path, out: Path) -> None:
        calls.append(gguf_path)
        write_tiny_model_folder(out)

    monkeypatch.setattr(convert, "write_converted_folder", write)
    mine = tmp_path / "files" / "my-model.Q4_0.gguf"
    mine.parent.mkdir()
    mine.write_bytes(b"GGUF")
    first = resolve_model_folder(str(mine), tmp_path / "home")
    assert first == tmp_path / "home" / "models" / "my-model.Q4_0"
    assert resolve_model_folder(str(mine), tmp_path / "home") == first and len(calls) == 1
    assert assets.source_gguf(first) == mine.resolve()
    other = tmp_path / "elsewhere" / "my-model.Q4_0.gguf"  # same name, another file
    other.parent.mkdir()
    other.write_bytes(b"GGUF")
    with pytest.raises(ModelFolderError, match="holds a model not converted from"):
        resolve_model_folder(str(other), tmp_path / "home")
    mine.unlink()  # a record of a file that is gone names nothing
    assert assets.source_gguf(first) is None
