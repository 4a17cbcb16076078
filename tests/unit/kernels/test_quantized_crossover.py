"""The row-kernel / dequantize crossover measured at engine start (kernels/quantized/crossover.py):
the decision rule on given costs, and a real measurement recorded once and then used by
`dequantize_from_rows`."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import native
from kernels.quantized import cpu as qcpu
from kernels.quantized import crossover
from kernels.quantized.layout import quantize_int4, quantize_int8
from tests.required import unavailable

CANDIDATES = (8, 16, 32, 64)


def costs(row_ms: dict[int, float], deq_ms: dict[int, float], asked: list[int]):
    def row(m: int) -> float:
        asked.append(m)
        return row_ms[m]
    return row, lambda m: deq_ms[m]


def test_the_crossover_is_the_first_count_won_twice_in_a_row_and_larger_counts_are_not_timed() -> None:
    asked: list[int] = []
    row, deq = costs({8: 1, 16: 2, 32: 4, 64: 8}, {8: 3, 16: 2.5, 32: 3, 64: 4}, asked)
    assert crossover.first_win(row, deq, CANDIDATES) == 32
    assert asked == [8, 16, 32, 64]
    asked.clear()
    row, deq = costs({8: 1, 16: 2, 32: 4, 64: 8}, {8: 3, 16: 1.9, 32: 5, 64: 4}, asked)  # 16 won once: noise
    assert crossover.first_win(row, deq, CANDIDATES) == 64  # the last candidate needs no second win
    asked.clear()
    row, deq = costs({8: 4, 16: 5, 32: 6, 64: 7}, {8: 1, 16: 1, 32: 1, 64: 1}, asked)
    assert crossover.first_win(row, deq, CANDIDATES) == 8 and asked == [8, 16]  # 32 and 64 never run
    row, deq = costs({8: 1, 16: 1, 32: 1, 64: 1}, {8: 2, 16: 2, 32: 2, 64: 2}, [])
    assert crossover.first_win(row, deq, CANDIDATES) == 128  # the rows never lose: past the last


def test_calibrate_measures_each_kind_once_and_dequantize_from_rows_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    monkeypatch.setattr(qcpu, "_MEASURED", {})
    monkeypatch.setattr(crossover, "MAX_LAYERS", 1)
    monkeypatch.setattr(crossover, "ROUNDS", 1)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * 0.05
    packings = [qcpu.pack_for_cpu(quantize_int8(w), torch.float32, "native"),
                qcpu.pack_for_cpu(quantize_int4(w, 32), torch.float32, "native"),
                qcpu.pack_for_cpu(quantize_int8(w), torch.float32, "torch")]  # not native: not measured
    shipped = qcpu.dequantize_from_rows(packings[0], False)
    recorded = crossover.calibrate(packings)
    # the float row kernels and the int8-activation ones of decode steps (every native packing allows them)
    assert set(recorded) == {(torch.float32, bits, rounded) for bits in (8, 4) for rounded in (False, True)}
    for packed in packings[:2]:
        assert packed.int8_activations
        for rounded, candidates in ((False, crossover.FLOAT_ROWS), (True, crossover.Q8_ROWS)):
            rows = recorded[(torch.float32, packed.bits, rounded)]
            assert rows in (*candidates, 2 * candidates[-1])
            assert qcpu.dequantize_from_rows(packed, rounded) == rows
    assert shipped == qcpu.DEQUANTIZE_FROM_ROWS[(torch.float32, 8)]
    assert crossover.calibrate(packings) == {}  # once per process and kind
