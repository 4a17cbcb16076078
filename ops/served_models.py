"""The models one `tollway up` serves: `--model` specs, their served names, and the workers' layout.

A spec is what `tollway up --model` takes (repeatable):

- `SOURCE`: a built-in name or the name of a folder under `$TOLLWAY_HOME/models/`, served under that
  name; or a path (it contains a `/`, starts with `.` or `~`, ends with `.gguf`, or exists), served
  under its folder's name (a `.gguf` file: its stem, the folder it converts into);
- `NAME=SOURCE`: SOURCE served under NAME.

The served name is the model id clients send, `/v1/models` lists, usage rows, prices and reports
carry. It must be a URL path segment (`GET /v1/models/{model}`): letters, digits, `.`, `_`, `-`, `:`,
at most 200 characters (the accounting tables' model column). Two specs with the same served name are
refused: the gateway could not tell their workers apart.

Layout: `--workers N` engine workers per model, ports from the first worker port on, model after
model (model 0's workers first). The cores are shared equally among all of them, whatever model
each serves (TOLLWAY_NUM_THREADS, when set, applies to every worker instead).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_NAME_LENGTH = 200  # accounting's usage_events.model / prices.model: String(200)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


class ModelSpecError(ValueError):
    """A `--model` spec that cannot be served (bad name, duplicate)."""


@dataclass(frozen=True)
class ServedModel:
    name: str  # the id clients send as `model`
    source: str  # what `tollway worker --model` loads: a name, or an absolute path


@dataclass(frozen=True)
class WorkerSlot:
    index: int  # worker-{index}: its child name and log file
    port: int
    model: ServedModel | None  # None: the worker's own default (TOLLWAY_MODEL), as `up` without --model


def is_valid_name(name: str) -> bool:
    return len(name) <= MAX_NAME_LENGTH and NAME_PATTERN.fullmatch(name) is not None


def _looks_like_path(source: str) -> bool:
    return "/" in source or source.startswith((".", "~")) or source.endswith(".gguf") or Path(source).exists()


def parse_model_spec(spec: str) -> ServedModel:
    """One `--model` value as a served model; ModelSpecError says what is wrong with it."""
    spec = spec.strip()
    name, sep, rest = spec.partition("=")
    if sep and is_valid_name(name):
        if not rest.strip():
            raise ModelSpecError(f"--model {spec!r}: nothing to serve after '='")
        source = rest.strip()
    elif sep and "/" not in name:
        raise ModelSpecError(f"--model {spec!r}: {name!r} is not a valid model name (letters, digits, '.', '_', "
                             f"'-', ':'; at most {MAX_NAME_LENGTH} characters)")
    else:
        name, source = "", spec
    if not source:
        raise ModelSpecError("--model needs a model name or path")
    if _looks_like_path(source):
        path = Path(source).expanduser().resolve()
        source = str(path)
        name = name or (path.stem if path.suffix == ".gguf" else path.name)
    else:
        name = name or source
    if not is_valid_name(name):
        raise ModelSpecError(f"--model {spec!r}: {name!r} cannot be a model id (letters, digits, '.', '_', '-', "
                             f"':'; at most {MAX_NAME_LENGTH} characters); give one as NAME={source}")
    return ServedModel(name, source)


def parse_model_specs(specs: Sequence[str]) -> list[ServedModel]:
    """Every `--model` value, in order; two that would be served under one name are refused."""
    models = [parse_model_spec(spec) for spec in specs]
    seen: dict[str, ServedModel] = {}
    for model in models:
        if model.name in seen:
            other = seen[model.name]
            what = "given twice" if other.source == model.source else f"both {other.source} and {model.source}"
            raise ModelSpecError(f"--model: the model id {model.name!r} is {what}; serve each model once "
                                 f"(NAME=SOURCE names one)")
        seen[model.name] = model
    return models


def check_model_sources(models: Sequence[ServedModel], home: Path) -> None:
    """Refuse, before anything starts, a model no worker could load: an unknown name, a missing file, a
    folder that is not a model (ModelNotFoundError / ModelFolderError, as the worker would raise).
    Nothing is converted or loaded here; the workers do that."""
    from workers.models.assets import (
        BUILTIN_MODELS,
        ModelFolderError,
        ModelNotFoundError,
        available_models,
        check_model_folder,
    )

    for model in models:
        path = Path(model.source)
        if path.is_absolute():
            if path.suffix == ".gguf":
                if not path.is_file():
                    raise ModelFolderError(f"{path} is not a file")
            else:
                check_model_folder(path)
        elif not (home / "models" / model.source / "config.json").exists():
            builtin = BUILTIN_MODELS.get(model.source)
            if builtin is None:
                raise ModelNotFoundError(f"unknown model {model.source!r}; available: "
                                         f"{', '.join(available_models(home))} (or pass the path of a model folder)")
            if builtin.locate() is None:
                raise ModelNotFoundError(f"model {model.source!r} needs the package {builtin.package!r}: "
                                         f"{builtin.install_hint}")


def worker_layout(models: Sequence[ServedModel], workers_per_model: int, first_port: int) -> list[WorkerSlot]:
    """The engine workers of `tollway up`: `workers_per_model` per model on consecutive ports; with no
    model given, `workers_per_model` workers of the default model, as before several models existed."""
    per_model: Sequence[ServedModel | None] = models or [None]
    slots: list[WorkerSlot] = []
    for model in per_model:
        for _ in range(workers_per_model):
            index = len(slots)
            slots.append(WorkerSlot(index, first_port + index, model))
    return slots


def threads_per_worker(num_workers: int, cpu_count: int) -> int:
    """Each worker's equal share of the cores (at least one thread each: more workers than cores share)."""
    return max(1, cpu_count // max(1, num_workers))
