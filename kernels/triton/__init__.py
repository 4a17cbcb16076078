"""The Triton backend: paged attention kernels for CUDA (or Triton's CPU interpreter under
`TRITON_INTERPRET=1`).

`decode.py` flash-decoding over the block tables, `extend.py` prefill on a cached prefix,
`store.py` K/V writes into their slots, `common.py` the launchers' shared helpers and jitted tile
functions, `ops.py` the backend interface the dispatch calls (`store_kv`, `decode_step`,
`extend_step`). Importing this package imports the real `triton` (absolute imports), so the
dispatch imports it only when a step first runs on this backend.
"""

from kernels.triton.ops import decode_step, extend_step, store_kv

__all__ = ["decode_step", "extend_step", "store_kv"]
