"""Attention ops: torch reference and CPU path now, Triton kernels for CUDA later; one dispatch point."""
