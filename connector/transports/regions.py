"""A registered KV tensor as flat bytes: zero-copy views on CPU; a device tensor's bytes are staged through
host memory (staging.py batches a request's ops into one copy; view/store here copy op by op)."""

from __future__ import annotations

from typing import Any

import numpy
import torch

from kvledger.connector.transports.base import Op


class RegionError(ValueError):
    """An op outside the region's bytes."""


class TensorRegion:
    """The bytes a tensor spans (its extent from its first element), addressable by offset.

    Offsets are from the tensor's first element, as layout.py computes them, so
    strided views (a K/V half of a cache, a permuted layout) work as long as the
    ops name bytes the tensor really covers.
    """

    def __init__(self, tensor: torch.Tensor, *, staged: bool | None = None) -> None:
        if tensor.dim() == 0:
            raise RegionError("a KV region must have at least one dim")
        extent = 0
        if tensor.numel():
            extent = (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True)) + 1) * (
                tensor.element_size()
            )
        self.size = extent
        self.tensor = tensor  # keeps the storage alive while peers may address it
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        flat.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (extent,), (1,))
        self.flat = flat
        self.on_host = tensor.device.type == "cpu"
        self.staged = not self.on_host if staged is None else staged
        """Whether a transport moves this region's bytes through its staging buffers (staging.py): every device
        region; a CPU region only where asked (tests run the device path's gather and scatter on CPU)."""
        if not self.on_host and not self.staged:
            raise RegionError(f"a {tensor.device.type} region has no host bytes to address: it must be staged")
        self._array: Any = flat.numpy() if self.on_host else None

    def check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise RegionError(f"bytes [{offset}, {offset + size}) outside a region of {self.size} bytes")

    def view(self, offset: int, size: int) -> memoryview:
        """The bytes at `offset` (zero-copy on CPU; a staged host copy for a device tensor)."""
        self.check(offset, size)
        if self.on_host:
            host: memoryview = self._array[offset : offset + size].data
            return host
        device: memoryview = self.flat[offset : offset + size].cpu().numpy().data
        return device

    def writable(self, offset: int, size: int) -> memoryview | None:
        """A writable view of host bytes to receive into directly; None for a device tensor."""
        self.check(offset, size)
        if not self.on_host:
            return None
        writable: memoryview = self._array[offset : offset + size].data
        return writable

    def store(self, offset: int, data: memoryview | bytes) -> None:
        """Copy `data` in at `offset` (through the host for a device tensor)."""
        size = len(data)
        self.check(offset, size)
        if self.on_host:
            self._array[offset : offset + size] = numpy.frombuffer(data, dtype=numpy.uint8)
        else:
            source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.flat[offset : offset + size].copy_(source)

    def check_ops(self, ops: list[Op] | tuple[Op, ...], *, local: bool) -> None:
        for lo, ro, size in ops:
            self.check(lo if local else ro, size)
