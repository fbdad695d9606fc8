"""The held plot's end labels: one per line, never on top of each other, however the lines end."""

from __future__ import annotations

import itertools
import re

import pytest

from kvledger.api.plots import LABEL_GAP_PX, _end_labels

Y_MIN, Y_MAX = 20.0, 200.0


def _ys(ends: list[tuple[float, str, str, str]]) -> list[float]:
    labels = _end_labels(ends, 700.0, Y_MIN, Y_MAX)
    assert len(labels) == len(ends)
    return sorted(float(re.search(r'\by="([0-9.]+)"', str(label)).group(1)) for label in labels)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "levels",
    [
        [Y_MAX] * 5,  # five lines that all end at 0, the plot's foot
        [Y_MAX, Y_MAX - 1, Y_MAX - 2, 100.0, 101.0],
        [Y_MIN] * 4,  # all at the top
        [50.0, 120.0, 190.0],  # far apart: each stays by its line
    ],
)
def test_end_labels_keep_their_gap(levels: list[float]) -> None:
    ys = _ys([(level, f"source-{i}", "0 now", "#000") for i, level in enumerate(levels)])
    assert all(b - a >= LABEL_GAP_PX - 1e-9 for a, b in itertools.pairwise(ys)), ys
    assert ys[-1] <= Y_MAX + 20


def test_a_label_alone_sits_by_its_line() -> None:
    assert _ys([(120.0, "decode-0/tp0", "5 now", "#000")]) == [124.0]
