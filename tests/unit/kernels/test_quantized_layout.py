"""The quantized weight layout: int4 packing is exact, round trips stay within their step."""

import pytest
import torch

from kernels.quantized.layout import (
    QuantizedWeight,
    dequantize,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def test_int4_pack_unpack_is_exact_and_nibble_order_is_fixed() -> None:
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(codes)
    assert packed.shape == (7, 32)
    assert torch.equal(unpack_int4(packed), codes)
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)


def test_int8_round_trip_error_is_at_most_half_a_step_per_row() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (64, 1) and q.mins is None
    error = (dequantize(q) - w).abs()
    assert (error <= q.scales / 2 + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_error_is_at_most_half_a_step_per_group(group_size: int) -> None:
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    q = quantize_int4(w, group_size)
    assert q.qweight.shape == (16, 128) and q.scales.shape == (16, 256 // group_size)
    step = q.scales.repeat_interleave(group_size, dim=1)
    assert ((dequantize(q) - w).abs() <= step / 2 + 1e-6).all()


def test_int4_of_values_already_on_the_grid_is_exact() -> None:
    """Float weights that are dequantized Q4_1 blocks (the built-in model's) come back unchanged."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (8, 64), generator=gen)
    codes[:, 0], codes[:, 1] = 0, 15  # each group spans the whole code range, as min-max Q4_1 blocks do
    codes[:, 32], codes[:, 33] = 0, 15
    scale, low = torch.rand(8, 2, generator=gen) + 0.1, torch.randn(8, 2, generator=gen)
    w = codes.float().view(8, 2, 32) * scale.unsqueeze(-1) + low.unsqueeze(-1)
    q = quantize_int4(w.view(8, 64), 32)
    assert torch.allclose(dequantize(q), w.view(8, 64), atol=1e-5)


def test_a_layout_that_does_not_tile_is_refused() -> None:
    with pytest.raises(ValueError, match="tile"):
        QuantizedWeight(bits=8, qweight=torch.zeros(4, 10, dtype=torch.int8), scales=torch.ones(4, 3),
                        mins=None, group_size=4)
    with pytest.raises(ValueError, match="mins"):
        QuantizedWeight(bits=4, qweight=torch.zeros(4, 8, dtype=torch.uint8), scales=torch.ones(4, 1),
                        mins=None, group_size=16)
