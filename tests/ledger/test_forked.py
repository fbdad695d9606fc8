"""A forked child's bytes come back with its CPU time; it runs below its parent's priority; a failure says why."""

from __future__ import annotations

import os

import pytest

from kvledger.ledger.forked import FORKED_CHILD_NICE, ChildFailed, fork_making


def test_the_child_makes_the_bytes_at_a_lower_priority_than_its_parent() -> None:
    parent = os.getpriority(os.PRIO_PROCESS, 0)
    child = fork_making(lambda: str(os.getpriority(os.PRIO_PROCESS, 0)).encode())
    body, cpu_s = child.result()
    assert int(body) == min(19, parent + FORKED_CHILD_NICE) > parent or parent == 19
    assert cpu_s >= 0.0
    assert os.getpriority(os.PRIO_PROCESS, 0) == parent  # the parent's own is unchanged


def test_a_child_whose_making_raises_fails_with_its_traceback() -> None:
    def make() -> bytes:
        raise ValueError("no fold here")

    with pytest.raises(ChildFailed, match="no fold here"):
        fork_making(make).result()
