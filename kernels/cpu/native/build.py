"""Compiling the native sources (`SOURCES`, with the `HEADERS` they include) once per machine into
one library and loading it into the process.

The shared library is cached under `$TOLLWAY_KERNEL_CACHE` (default `~/.cache/tollway/kernels`) in a
folder named by a hash of the sources and headers, the compiler flags and the torch version, so a new source, a
different torch or a CPU with other vector units builds its own copy and never loads a stale one.
The vector flags come from what torch detected on this CPU at run time
(`torch.backends.cpu.get_cpu_capability()`: AVX512 or AVX2); never `-march=native`, so the cache
key names every instruction set the library may use. A CPU with neither gets no native library.
Each source compiles to its own object file, as many at once as the machine has cores (on 2 cores the
library took ~210 s compiled as one command, ~105 s this way), then one link makes the library.
Concurrent first builds (several workers starting together) serialise on a lock file; the
library is written under a temporary name and renamed into place, so a reader never sees half of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "tollway_cpu.cpp", "paged_decode.cpp", "layer_ops.cpp", "quantized_matmul.cpp",
    "quantized_q8.cpp", "quantized_vnni.cpp", "quantized_avx2.cpp", "quantized_tiles.cpp", "head_ops.cpp",
    "layer_stack.cpp", "decode_metadata.cpp", "few_rows.cpp", "few_rows_bf16.cpp", "few_rows_amx.cpp"))
"""Compiled together into one library (`tollway_cpu.cpp` defines it, the others add their ops): the decode
step's attention and small fused ops, the LM head's logits refinement, and the weight-only quantized matmuls (the int8-activation ones in an AVX2
build and an AVX512-VNNI one, the latter compiled for that extension alone and called only where the CPU has it)."""
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("amx.h", "common.h", "few_rows.h", "paged_decode.h", "paged_decode_bf16.h", "paged_prefill.h",
                             "paged_prefill_amx.h", "paged_prefill_bf16.h", "quantized_q8.h", "step_ops.h"))
"""Included by the sources: part of the cache key as they are."""
VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}
# -ffp-contract=off: no fused multiply-adds where the source does not ask for them, so the fp32
# elementwise ops round as torch's eager ops do.
# -fopenmp: at::parallel_for is OpenMP pragmas inlined into our code; without it every op ran on one thread.
# The library then needs libgomp.so.1, which torch has already loaded (its own copy): one OpenMP runtime.
BASE_FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden",
              f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]


class BuildError(RuntimeError):
    """The native library cannot be had on this machine; the message says why."""


def cache_root() -> Path:
    configured = os.environ.get("TOLLWAY_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "tollway" / "kernels"


def vector_flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    for name, flags in VECTOR_FLAGS.items():
        if capability.startswith(name):
            return flags
    raise BuildError(f"this CPU offers torch {capability!r}; the native kernels need AVX2 or AVX512")


def compiler() -> str:
    name = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not name:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    return name


def compile_command(source: Path, output: Path) -> list[str]:
    """One source to an object file."""
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    flags = [flag for flag in BASE_FLAGS if flag != "-shared"]
    return [compiler(), *flags, *vector_flags(), *includes, "-c", str(source), "-o", str(output)]


def link_command(objects: list[Path], output: Path) -> list[str]:
    """The objects to the shared library, against torch's libraries."""
    libraries = [f"-L{cpp_extension.TORCH_LIB_PATH}" if hasattr(cpp_extension, "TORCH_LIB_PATH")
                 else f"-L{Path(torch.__file__).parent / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch"]
    return [compiler(), "-shared", "-fopenmp", *map(str, objects), "-o", str(output), *libraries]


def run_compiler(args: list[str], what: str) -> None:
    """Raises BuildError with the compiler's own message where it fails."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"the compiler did not run: {exc}") from exc
    if result.returncode != 0:
        raise BuildError(f"{what} failed:\n{result.stderr[-4000:]}")


def compile_library(output: Path) -> None:
    """Every source compiled (in parallel, one job a core) in a scratch folder, then linked to `output`."""
    with tempfile.TemporaryDirectory(prefix="objects-", dir=output.parent) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            jobs = [pool.submit(run_compiler, compile_command(source, obj), f"compiling {source.name}")
                    for source, obj in zip(SOURCES, objects, strict=True)]
            for job in jobs:
                job.result()  # the first failure, in source order, after every job has ended
        run_compiler(link_command(objects, output), "linking the native library")


def library_path() -> Path:
    """Where this machine's build of the current source lives (it may not exist yet)."""
    key_parts = [*(source.read_bytes() for source in (*SOURCES, *HEADERS)), " ".join([*BASE_FLAGS, *vector_flags()]).encode(),
                 torch.__version__.encode()]
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    return cache_root() / f"tollway_cpu-{key}" / "tollway_cpu.so"


def build(progress: bool = True) -> Path:
    """The path of a built library, compiling it first when absent (1-2 minutes on 2 cores). Raises BuildError."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if target.exists():
            return target
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        if progress:
            print(f"tollway: building the native CPU kernels once for this machine into {target.parent} "
                  f"(1-2 minutes on 2 cores)...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            compile_library(partial)
        except BuildError:
            partial.unlink(missing_ok=True)
            raise
        partial.rename(target)
        if progress:
            print(f"tollway: native CPU kernels built in {time.perf_counter() - start:.0f} s", file=sys.stderr,
                  flush=True)
    return target
