"""KV content for the simulator: a prefill writes a request's blocks, a checksum per block proves arrival."""

from __future__ import annotations

import zlib

import torch

from kvledger.connector.mamba import MambaGroup

CONTENT_SEED_STRIDE = 1_000_003
"""Keeps the content of request n of seed s apart from every other (seed, n) pair."""


MAMBA_SUFFIX = ".mamba"
"""The simulator's Mamba layers' names end so: their blocks are the request's state block, not its KV blocks."""


def make_caches(
    layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, mamba_layers: int = 0
) -> dict[str, torch.Tensor]:
    """One tensor per layer, zeroed, laid out as vLLM's flash-attention backends lay a KV cache: K and V apart,
    `(2, num_blocks, block_size, kv_heads, head_dim)` float32, seen block-first (a permuted view, shape
    `(num_blocks, 2, ...)`) so that `tensor[block]` is one block's K and V. A block's V lies `num_blocks`
    blocks after its K, so an engine that restarts with another `num_blocks` moves every V (peer_restart_layout);
    an op's first local offset, a K run's, still names its block. Mamba layers (hybrid requests) follow: one
    state page per block, conv then SSM state, `(num_blocks, 1, 1, 3 * head_dim)`."""
    caches = {
        f"layers.{i}.attn": torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32).permute(
            1, 0, 2, 3, 4
        )
        for i in range(layers)
    }
    for i in range(layers, layers + mamba_layers):
        caches[f"layers.{i}{MAMBA_SUFFIX}"] = torch.zeros(num_blocks, 1, 1, 3 * head_dim, dtype=torch.float32)
    return caches


def _layer_blocks(name: str, blocks: tuple[int, ...], state_blocks: int) -> tuple[int, ...]:
    """The blocks of `blocks` that layer `name` uses: a Mamba layer its state blocks (the tail), others the rest."""
    if name.endswith(MAMBA_SUFFIX):
        return blocks[len(blocks) - state_blocks :] if state_blocks else ()
    return blocks[: len(blocks) - state_blocks]


def block_stride_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.stride(0)) * int(tensor.element_size())


def prefill(
    caches: dict[str, torch.Tensor], blocks: tuple[int, ...], seed: int, number: int, state_blocks: int = 0
) -> list[int]:
    """Write request `number`'s KV into `blocks` of every layer (the prefill's forward; a Mamba layer its state
    into the last `state_blocks`); return its checksums."""
    generator = torch.Generator().manual_seed(seed * CONTENT_SEED_STRIDE + number)
    for name, tensor in caches.items():
        mine = _layer_blocks(name, blocks, state_blocks)
        if mine:
            index = torch.tensor(mine, dtype=torch.long)
            tensor[index] = torch.randn((len(mine), *tensor.shape[1:]), generator=generator)
    return checksums(caches, blocks, state_blocks)


def checksums(caches: dict[str, torch.Tensor], blocks: tuple[int, ...], state_blocks: int = 0) -> list[int]:
    """crc32 of each block's bytes, layer by layer, in block-list order (a Mamba layer's state blocks only)."""
    return [
        zlib.crc32(tensor[block].numpy().tobytes())
        for name, tensor in caches.items()
        for block in _layer_blocks(name, blocks, state_blocks)
    ]


def sim_mamba_groups(caches: dict[str, torch.Tensor]) -> tuple[MambaGroup, ...]:
    """The simulator's Mamba layers as one Mamba KV cache group (group 1, after the attention layers')."""
    layers = tuple(name for name in caches if name.endswith(MAMBA_SUFFIX))
    if not layers:
        return ()
    state = caches[layers[0]].shape[-1]
    conv, ssm = state // 3, state - state // 3
    return (
        MambaGroup(
            group=1,
            layers=layers,
            shapes=((conv,), (ssm,)),
            dtypes=("float32", "float32"),
            page_bytes=block_stride_bytes(caches[layers[0]]),
        ),
    )
