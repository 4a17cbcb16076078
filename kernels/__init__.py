"""Paged attention behind one dispatch point, `dispatch.paged_attention`, with three backends:
`reference.py` (slow, obviously correct torch: the yardstick), `cpu/` (batched torch ops, the
default off CUDA) and `triton/` (Triton kernels, the default on CUDA). `metadata.py` describes one
step for every layer: its sequences, block tables, slots and the backend that runs it.
Nothing here imports `cache`, `workers` or the gateway."""
