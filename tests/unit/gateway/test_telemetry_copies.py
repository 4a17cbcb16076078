"""The shared tracing plumbing is one file per side (gateway/ and workers/ may not import each other)."""

from __future__ import annotations

from pathlib import Path


def test_the_two_telemetry_copies_stay_identical() -> None:
    """gateway/ and workers/ may not import each other, so each owns telemetry.py: same code below
    the docstring."""
    root = Path(__file__).resolve().parents[2]

    def code(side: str) -> str:
        text = (root / side / "telemetry.py").read_text()
        return text[text.index('"""', 3) + 3:]

    assert code("gateway") == code("workers")
