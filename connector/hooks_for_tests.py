"""Test-only hooks, off unless a test names them in `kv_connector_extra_config`; never used in production."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

NOISE_SCALE = 100.0
"""Far outside the range of real keys and values, so that attention over them changes the output."""


def corrupt_blocks(caches: Mapping[str, Any], block_axes: Mapping[str, int], block_ids: Iterable[int]) -> int:
    """`test_hook_corrupt_received_kv`: overwrite these blocks of every layer with noise; returns blocks touched."""
    import torch

    blocks = sorted(set(block_ids))
    generator = torch.Generator().manual_seed(0)
    for name, tensor in caches.items():
        axis = block_axes[name]
        for block in blocks:
            view = tensor.select(axis, block)
            noise = torch.randn(view.shape, generator=generator, dtype=torch.float32) * NOISE_SCALE
            view.copy_(noise.to(view.dtype))
    return len(blocks)
