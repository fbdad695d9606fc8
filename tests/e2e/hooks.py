"""Test hooks the connector calls only when a test names them in `kv_connector_extra_config`.

`"test_hook_received_kv": CORRUPT_RECEIVED_KV` makes a consumer overwrite every block it received with
noise: the negative control that shows a decode really used the transferred KV (its output must
change). The connector imports the hook by that name in the engine's process, which finds this
package because the engine runs with the repository root on PYTHONPATH (`harness.engine_env`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

NOISE_SCALE = 100.0
"""Far outside the range of real keys and values, so that attention over them changes the output."""


def corrupt_blocks(caches: Mapping[str, Any], block_axes: Mapping[str, int], block_ids: Iterable[int]) -> int:
    """Overwrite these blocks of every layer with noise; returns the blocks touched."""
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


CORRUPT_RECEIVED_KV = f"{__name__}:{corrupt_blocks.__name__}"
"""The `test_hook_received_kv` value that plugs `corrupt_blocks` in."""
