"""KV content for the simulator: a prefill writes a request's blocks, a checksum per block proves arrival."""

from __future__ import annotations

import zlib

import torch

CONTENT_SEED_STRIDE = 1_000_003
"""Keeps the content of request n of seed s apart from every other (seed, n) pair."""


def make_caches(layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """One block-major tensor per layer, `(num_blocks, 2, block_size, kv_heads, head_dim)` float32 (K and V
    interleaved per block), zeroed. Block-major keeps a block's bytes in one run, so an op's first local
    offset names its block."""
    return {
        f"layers.{i}.attn": torch.zeros(num_blocks, 2, block_size, kv_heads, head_dim, dtype=torch.float32)
        for i in range(layers)
    }


def block_stride_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.stride(0)) * int(tensor.element_size())


def prefill(caches: dict[str, torch.Tensor], blocks: tuple[int, ...], seed: int, number: int) -> list[int]:
    """Write request `number`'s KV into `blocks` of every layer (the prefill's forward); return its checksums."""
    generator = torch.Generator().manual_seed(seed * CONTENT_SEED_STRIDE + number)
    index = torch.tensor(blocks, dtype=torch.long)
    for tensor in caches.values():
        tensor[index] = torch.randn((len(blocks), *tensor.shape[1:]), generator=generator)
    return checksums(caches, blocks)


def checksums(caches: dict[str, torch.Tensor], blocks: tuple[int, ...]) -> list[int]:
    """crc32 of each block's bytes, layer by layer, in block-list order."""
    return [zlib.crc32(tensor[block].numpy().tobytes()) for tensor in caches.values() for block in blocks]
