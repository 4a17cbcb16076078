"""Weight-only quantized matrices: the one storage layout (`layout.py`) that loaders produce
(quantized afresh from float weights, or read from GGUF blocks) and that every matmul backend
consumes (torch's CPU weight-only ops, the Triton dequant-matmul kernels on GPUs in
`triton_matmul.py`, which imports `triton`: import it only where the kernels run)."""
