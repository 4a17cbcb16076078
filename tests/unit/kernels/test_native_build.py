"""The native library's cache key (kernels/cpu/native/build.py): every file compiled into the library, headers
included, is part of it, so an edited header builds a new library instead of loading a stale one."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tests.required import unavailable

build = importlib.import_module("kernels.cpu.native.build")  # the package exports a function named build too


def test_every_included_header_is_part_of_the_key() -> None:
    included = {name for path in (*build.SOURCES, *build.HEADERS)
                for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included  # the sources do include our headers
    assert included <= {path.name for path in build.HEADERS}
    assert all(path.exists() for path in (*build.SOURCES, *build.HEADERS))


def test_an_edited_header_names_a_new_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        build.vector_flags()
    except build.BuildError as exc:
        unavailable(str(exc))  # no AVX2/AVX512: no library, no key (a failure under CI)
    header = tmp_path / "common.h"
    header.write_text("// one\n")
    monkeypatch.setattr(build, "HEADERS", (*build.HEADERS, header))
    before = build.library_path()
    assert build.library_path() == before
    header.write_text("// two\n")
    assert build.library_path() != before


def test_an_installed_package_ships_every_source_and_header() -> None:
    """A wheel holds what pyproject's package-data names: the library is compiled from these on the serving machine."""
    import fnmatch
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["kernels.cpu.native"]
    for path in (*build.SOURCES, *build.HEADERS):
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns), path.name


def sources_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, texts: dict[str, str]) -> None:
    """The build compiles these small sources instead of the library's (no vector flags)."""
    try:
        build.compiler()
    except build.BuildError as exc:
        unavailable(str(exc))
    sources = []
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
        sources.append(tmp_path / name)
    monkeypatch.setattr(build, "SOURCES", tuple(sources))
    monkeypatch.setattr(build, "vector_flags", lambda: [])


def test_sources_compile_separately_and_link_into_one_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    sources_instead(tmp_path, monkeypatch, {
        "one.cpp": 'extern "C" int tollway_one() { return 1; }\n',
        # the build hides symbols by default (-fvisibility=hidden)
        "two.cpp": 'extern "C" int tollway_one();\n'
                   'extern "C" __attribute__((visibility("default"))) int tollway_two() { return tollway_one() + 1; }\n',
    })
    output = tmp_path / "lib.so"
    build.compile_library(output)
    assert ctypes.CDLL(str(output)).tollway_two() == 2
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("objects-")] == []  # scratch removed


def test_a_failing_source_is_named_in_the_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources_instead(tmp_path, monkeypatch, {"good.cpp": "int tollway_good() { return 1; }\n",
                                            "bad.cpp": "#error this source is broken on purpose\n"})
    with pytest.raises(build.BuildError, match=r"compiling bad\.cpp failed:(.|\n)*broken on purpose"):
        build.compile_library(tmp_path / "lib.so")
    assert not (tmp_path / "lib.so").exists()
