"""KV layout geometry: where each block of each layer lies, from the tensor's own shape and strides.

Layers may differ (dense K/V layers beside index-only layers; K and V separated
as `(2, num_blocks, ...)` or interleaved as `(num_blocks, 2, ...)`; permuted
views), so nothing here assumes one layout: a block is the set of byte runs
obtained by fixing the block axis, found from the strides. The runs of one
geometry are computed once and cached. vLLM's CPU KV cache is one tensor per
layer whose block axis is the one of size `num_blocks` (0.32: `(2, num_blocks,
block_size, num_kv_heads, head_size)` on several backends, block-major on others).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import msgspec

from kvledger.connector.transports.base import Op, RegionDescriptor


class LayoutError(ValueError):
    """Two layers' blocks cannot be paired (different block contents, or more local blocks than remote)."""


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """A KV cache tensor's shape, strides (elements), element size and the axis indexing blocks."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int
    block_axis: int

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_axis]

    @property
    def extent_bytes(self) -> int:
        """Bytes from the first element to one past the last (what a transport registers)."""
        if any(size == 0 for size in self.shape):
            return 0
        last = sum((size - 1) * stride for size, stride in zip(self.shape, self.stride, strict=True))
        return (last + 1) * self.itemsize


class LayerDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """One layer as a peer sees it in the handshake: name, geometry and the transport's region."""

    name: str
    geometry: Geometry
    region: RegionDescriptor


class BlockPlan(msgspec.Struct, frozen=True):
    """Per block: `block_stride` bytes between blocks; runs of `run_bytes` at `run_offsets` from its start."""

    block_stride: int
    run_offsets: tuple[int, ...]
    run_bytes: int


def _infer_block_axis(shape: tuple[int, ...], num_blocks: int | None) -> int:
    if len(shape) < 2:
        raise LayoutError(f"a KV cache tensor has at least 2 dims, got shape {shape}")
    separated = shape[0] == 2 and len(shape) >= 3
    if num_blocks is None:
        return 1 if separated else 0
    if separated and shape[1] == num_blocks:
        return 1
    if shape[0] == num_blocks:
        return 0
    if shape[1] == num_blocks:
        return 1
    raise LayoutError(f"no axis of size num_blocks={num_blocks} among the first two of shape {shape}")


def geometry_of(tensor: Any, num_blocks: int | None = None, block_axis: int | None = None) -> Geometry:
    """The geometry of a torch tensor (duck-typed: `.shape`, `.stride()`, `.element_size()`)."""
    shape = tuple(int(s) for s in tensor.shape)
    axis = _infer_block_axis(shape, num_blocks) if block_axis is None else block_axis
    if not 0 <= axis < len(shape):
        raise LayoutError(f"block_axis {axis} outside shape {shape}")
    return Geometry(
        shape=shape,
        stride=tuple(int(s) for s in tensor.stride()),
        itemsize=int(tensor.element_size()),
        block_axis=axis,
    )


@functools.lru_cache(maxsize=256)
def block_plan(geometry: Geometry) -> BlockPlan:
    """The byte runs of one block; cached per geometry since every layer of a model shares a few."""
    dims = sorted(
        (stride, size)
        for axis, (size, stride) in enumerate(zip(geometry.shape, geometry.stride, strict=True))
        if axis != geometry.block_axis and size > 1
    )
    run_elements = 1
    inner = 0
    for stride, size in dims:
        if stride != run_elements:
            break
        run_elements *= size
        inner += 1
    outer = dims[inner:]
    offsets = sorted(
        sum(index * stride for index, (stride, _) in zip(indices, outer, strict=True))
        for indices in itertools.product(*(range(size) for _, size in outer))
    )
    item = geometry.itemsize
    return BlockPlan(
        block_stride=geometry.stride[geometry.block_axis] * item,
        run_offsets=tuple(offset * item for offset in offsets),
        run_bytes=run_elements * item,
    )


def pair_blocks(local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[tuple[int, int]]:
    """Pair local with remote blocks: a shorter local list takes the remote tail (the head was a
    local prefix-cache hit); an empty one moves nothing (free-only); a longer one is an error."""
    if len(local_blocks) > len(remote_blocks):
        raise LayoutError(f"{len(local_blocks)} local blocks but only {len(remote_blocks)} remote blocks")
    if not local_blocks:
        return []
    tail = remote_blocks[len(remote_blocks) - len(local_blocks) :]
    return list(zip(local_blocks, tail, strict=True))


def block_ops(local: Geometry, remote: Geometry, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[Op]:
    """The (local offset, remote offset, size) ops moving `local_blocks` <-> `remote_blocks` of one layer,
    adjacent runs merged."""
    pairs = pair_blocks(local_blocks, remote_blocks)
    if not pairs:
        return []
    lp, rp = block_plan(local), block_plan(remote)
    if lp.run_bytes != rp.run_bytes or len(lp.run_offsets) != len(rp.run_offsets):
        raise LayoutError(
            f"block contents differ: local {len(lp.run_offsets)} runs of {lp.run_bytes} B, "
            f"remote {len(rp.run_offsets)} runs of {rp.run_bytes} B"
        )
    for block in pairs:
        if not (0 <= block[0] < local.num_blocks and 0 <= block[1] < remote.num_blocks):
            raise LayoutError(f"block pair {block} outside ({local.num_blocks}, {remote.num_blocks}) blocks")
    size = lp.run_bytes
    ops: list[Op] = []
    for local_run, remote_run in zip(lp.run_offsets, rp.run_offsets, strict=True):
        for local_block, remote_block in pairs:
            lo = local_block * lp.block_stride + local_run
            ro = remote_block * rp.block_stride + remote_run
            if ops:
                plo, pro, psize = ops[-1]
                if plo + psize == lo and pro + psize == ro:
                    ops[-1] = (plo, pro, psize + size)
                    continue
            ops.append((lo, ro, size))
    return ops
