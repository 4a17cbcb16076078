"""The tensor table of a GGUF file: names, GGML types, dims and raw bytes (memory-mapped), read
without materialising its metadata.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value; the built-in model's
vocabulary (49k tokens, 48k merges) makes that ~2-5 s of a quantized load. Here the metadata is
skipped with struct reads (~0.1 s) and only `general.architecture` and `general.alignment` are
kept. Format (little-endian, versions 2 and 3): magic "GGUF", version u32, tensor count u64, KV
count u64; KVs (key string, type u32, value); tensor infos (name string, n_dims u32, dims u64 x
n_dims innermost first, type u32, offset u64 from the aligned data start). A string is a u64 length
and UTF-8 bytes; an array is an item type u32, a count u64 and the items.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
KEPT_KEYS = ("general.architecture", "general.alignment")
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """A file that is not a GGUF this reader understands; the message says what is off."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """GGUF's dims, innermost first: (in_features, out_features) for a weight."""
    data: np.ndarray
    """The tensor's raw bytes (uint8, a view of the memory-mapped file)."""


@dataclass(frozen=True)
class GGUFFile:
    architecture: str
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.pos = buffer.data, 0  # the array's memoryview

    def take(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def count(self) -> int:
        return int(self.take("Q"))

    def string(self) -> str:
        n = self.count()
        text = bytes(self.buffer[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int, keep: bool) -> object:
        """One metadata value of type `kind`; arrays and unkept strings are skipped (None)."""
        if kind == STRING:
            if keep:
                return self.string()
            n = self.count()  # (not `pos += count()`: that adds to the pos before the length)
            self.pos += n
            return None
        if kind == ARRAY:
            item, n = int(self.take("I")), self.count()
            if item in SCALARS:
                self.pos += n * struct.calcsize("<" + SCALARS[item])
            else:
                for _ in range(n):
                    self.value(item, keep=False)
            return None
        if kind not in SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind} at byte {self.pos}")
        return self.take(SCALARS[kind])


def read_gguf(path: Path) -> GGUFFile:
    """The architecture and tensor table of the GGUF at `path` (its bytes memory-mapped, not read)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if raw.shape[0] < 24 or bytes(raw[:4]) != MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file")
    cursor = _Cursor(raw)
    cursor.pos = 4
    version = int(cursor.take("I"))
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} (versions 2 and 3 are read)")
    n_tensors, n_kv = cursor.count(), cursor.count()
    kept: dict[str, object] = {}
    for _ in range(n_kv):
        key = cursor.string()
        value = cursor.value(int(cursor.take("I")), keep=key in KEPT_KEYS)
        if key in KEPT_KEYS:
            kept[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.count() for _ in range(int(cursor.take("I"))))
        infos.append((name, GGMLQuantizationType(int(cursor.take("I"))), dims, cursor.count()))
    alignment = int(kept.get("general.alignment") or DEFAULT_ALIGNMENT)  # type: ignore[call-overload]
    start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, kind, dims, offset in infos:
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(dims)) * type_size // block
        if start + offset + n_bytes > raw.shape[0]:
            raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file")
        tensors[name] = GGUFTensor(name, kind, dims, raw[start + offset:start + offset + n_bytes])
    return GGUFFile(str(kept.get("general.architecture", "")), tensors)
