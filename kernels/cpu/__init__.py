"""The CPU backend: paged attention from batched torch ops, the engine's default off CUDA.

`attention.py` holds the decode and extend paths and the backend interface the dispatch calls
(`store_kv`, `decode_step`, `extend_step`); `cascade.py` the decode over prefixes shared by a group
of sequences (read once per group); `common.py` the masks and gather buffers both use.
"""

from kernels.cpu.attention import (
    DecodePlan,
    ExtendSequence,
    decode_attention,
    decode_step,
    extend_attention,
    extend_step,
    prepare_decode,
    prepare_extend,
    store_kv,
)

__all__ = [
    "DecodePlan",
    "ExtendSequence",
    "decode_attention",
    "decode_step",
    "extend_attention",
    "extend_step",
    "prepare_decode",
    "prepare_extend",
    "store_kv",
]
