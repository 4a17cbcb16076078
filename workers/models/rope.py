"""Rotary position embeddings (the "rotate half" layout Hugging Face checkpoints use)."""

from __future__ import annotations

import math

import torch

from workers.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies, fp32 [head_dim // 2], with the configured scaling applied.

    Computed with the same fp32 operations as transformers so that cos/sin tables match bit for bit.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "linear":
        return inv / rope.factor
    if rope.scaling_type != "llama3":
        return inv
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryTable:
    """cos/sin for every position up to a length that grows on demand (doubling).

    Tables are fp32 [num_positions, head_dim] (frequencies repeated for both halves) and are cast
    to the activation dtype when gathered, as transformers does.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, initial_positions: int = 4096) -> None:
        self._inv_freq = inverse_frequencies(rope, head_dim)
        self._cos = self._sin = torch.empty(0, head_dim, device="cpu")
        self._build(initial_positions)

    def _build(self, num_positions: int) -> None:
        positions = torch.arange(num_positions, dtype=torch.float32, device=self._inv_freq.device)
        freqs = positions[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = angles.cos(), angles.sin()

    def gather(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [...] as [..., 1, head_dim] (broadcast over heads), on their device."""
        self.reserve(max_position, positions.device)
        cos, sin = self.lookup(positions, dtype)
        return cos.unsqueeze(-2), sin.unsqueeze(-2)

    def reserve(self, max_position: int, device: torch.device) -> None:
        """Make the tables reach `max_position` (doubling) and live on `device`."""
        if max_position >= self._cos.shape[0]:
            self._build(max(2 * self._cos.shape[0], max_position + 1))
        if self._cos.device != device:
            self._cos, self._sin = self._cos.to(device), self._sin.to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., head_dim] for positions already `reserve`d: tensor ops only, so a compiled
        step can trace it (the tables are rebuilt only by `reserve`, outside the step)."""
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., H, D] by the per-position angles (cos/sin [..., 1, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
