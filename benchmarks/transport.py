"""The tcp transport's throughput on KV blocks against raw pyzmq moving the same bytes from host memory, in the
same run: for CPU tensors (the zero-copy path), for CPU tensors forced through the device path's staging, and,
where torch sees CUDA, for CUDA tensors (staged: one gather, one copy and one sync per request).

Each round is a READ of the same blocks of every layer (one request per layer, all issued, then waited for, as
the worker issues them): the serving side gathers and sends, the reading side receives and scatters, so both
staging directions are timed. The baseline is the same ops as frames between a DEALER and a ROUTER from numpy
arrays (zero-copy sends, recv_into a destination: one copy), pipelined the same way. Each figure is the best of
TRIALS (a shared machine slows runs, never speeds them). `bytes_equal`: every run's destination blocks equal
their source blocks, byte for byte, and no other block changed. The cuda fields are null without CUDA.
Targets: ratio_cpu >= 1.0, ratio_cuda >= 0.8.

Run: python benchmarks/transport.py [--quick]   (--quick: a few seconds, 4 MiB a round)
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a file, this file's folder comes first on sys.path and its name would shadow the `connector` package.
_here = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import zmq  # noqa: E402

from connector.layout import block_ops, geometry_of  # noqa: E402
from connector.transports.base import Op  # noqa: E402
from connector.transports.tcp import TcpTransport  # noqa: E402

FIELDS: tuple[str, ...] = (
    "tcp_gb_s_cpu",
    "tcp_staged_gb_s_cpu",
    "raw_zmq_gb_s",
    "ratio_cpu",
    "ratio_staged_cpu",
    "tcp_gb_s_cuda",
    "ratio_cuda",
    "bytes_equal",
    "layers",
    "blocks",
    "block_bytes",
    "round_bytes",
)
WAIT_S = 120.0
BLOCK_SHAPE = (16, 8, 64)
"""Tokens, KV heads, head size of one block's K (and V): 16 KiB of fp16 each, 32 KiB a block."""


@dataclass(frozen=True)
class Size:
    layers: int
    blocks: int
    rounds: int
    trials: int


FULL = Size(layers=16, blocks=128, rounds=4, trials=3)
"""64 MiB a round (16 layers x 128 blocks x 32 KiB): a long prompt's KV on a small model."""
QUICK = Size(layers=4, blocks=32, rounds=2, trials=2)


def caches(size: Size, device: str, seed: int) -> list[torch.Tensor]:
    """One K/V-split cache a layer, (2, blocks, tokens, heads, head size), twice the blocks read."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 2 * size.blocks, *BLOCK_SHAPE)
    return [
        torch.randint(0, 250, shape, generator=generator, dtype=torch.uint8).half().to(device)
        for _ in range(size.layers)
    ]


def read_ops(size: Size, cache: torch.Tensor) -> list[Op]:
    """The blocks read: every other block of the source into the first blocks of the target (no runs merge
    on the source side: one op per block and half, as a fragmented KV cache gives)."""
    geometry = geometry_of(cache, 2 * size.blocks)
    return block_ops(geometry, geometry, list(range(size.blocks)), list(range(0, 2 * size.blocks, 2)))


def moved_as_expected(size: Size, sources: list[torch.Tensor], targets: list[torch.Tensor], seed: int) -> bool:
    untouched = caches(size, "cpu", seed)
    for source, target, before in zip(sources, targets, untouched, strict=True):
        target, source = target.cpu(), source.cpu()
        if not torch.equal(target[:, : size.blocks], source[:, 0 : 2 * size.blocks : 2]):
            return False
        if not torch.equal(target[:, size.blocks :], before[:, size.blocks :]):
            return False
    return True


def tcp_bytes_per_s(size: Size, device: str, *, staged: bool) -> tuple[float, bool]:
    a = TcpTransport("127.0.0.1", 0, stage_host_regions=staged)
    b = TcpTransport("127.0.0.1", 0, stage_host_regions=staged)
    try:
        sources, targets = caches(size, device, 1), caches(size, device, 2)
        descriptors = [a.register(f"layer.{i}", source) for i, source in enumerate(sources)]
        for i, target in enumerate(targets):
            b.register(f"layer.{i}", target)
        session = b.connect(a.endpoint(), descriptors)
        ops = read_ops(size, sources[0])
        round_bytes = size.layers * sum(op[2] for op in ops)

        def one_round() -> None:
            handles = [b.read(session, f"layer.{i}", f"layer.{i}", ops) for i in range(size.layers)]
            assert b.wait_all(handles, WAIT_S), "a read did not finish"
            for handle in handles:
                assert handle.status().succeeded(), handle.status()

        one_round()  # warm-up: connections, staging buffers, page-ins
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(size.rounds):
            one_round()
        elapsed = time.perf_counter() - started
        return round_bytes * size.rounds / elapsed, moved_as_expected(size, sources, targets, 2)
    finally:
        a.close()
        b.close()


def raw_zmq_bytes_per_s(size: Size) -> tuple[float, bool]:
    """The same ops' bytes as frames from host numpy arrays: a ROUTER answers each layer's request with one
    zero-copy frame per op, the DEALER receives each into its destination (recv_into)."""
    sources, targets = caches(size, "cpu", 1), caches(size, "cpu", 2)
    ops = read_ops(size, sources[0])
    source_bytes = [s.view(-1).view(torch.uint8).numpy() for s in sources]
    target_bytes = [t.view(-1).view(torch.uint8).numpy() for t in targets]
    context: zmq.Context[Any] = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        replies = [[b"ok", *(array[ro : ro + n].data for _, ro, n in ops)] for array in source_bytes]
        while not stop.is_set():
            if server.poll(50):
                identity, layer = server.recv_multipart()
                server.send_multipart([identity, *replies[int(layer)]], copy=False)
        server.close(linger=0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = context.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{port}")

    def one_round() -> None:
        for layer in range(size.layers):
            client.send(str(layer).encode())
        for layer in range(size.layers):  # one connection, one server thread: replies in request order
            client.recv()
            array = target_bytes[layer]
            for lo, _, n in ops:
                assert client.getsockopt(zmq.RCVMORE)
                assert client.recv_into(array[lo : lo + n].data) == n

    try:
        one_round()
        started = time.perf_counter()
        for _ in range(size.rounds):
            one_round()
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        thread.join(2)
        client.close(linger=0)
        context.term()
    round_bytes = size.layers * sum(op[2] for op in ops)
    return round_bytes * size.rounds / elapsed, moved_as_expected(size, sources, targets, 2)


def best(trials: list[tuple[float, bool]]) -> tuple[float, bool]:
    return max(rate for rate, _ in trials), all(equal for _, equal in trials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds (CI)")
    size = QUICK if parser.parse_args().quick else FULL
    raw_runs: list[tuple[float, bool]] = []
    cpu_runs: list[tuple[float, bool]] = []
    staged_runs: list[tuple[float, bool]] = []
    cuda_runs: list[tuple[float, bool]] = []
    cuda = torch.cuda.is_available()
    for _ in range(size.trials):  # interleaved, so a burst of load elsewhere slows each kind alike
        raw_runs.append(raw_zmq_bytes_per_s(size))
        cpu_runs.append(tcp_bytes_per_s(size, "cpu", staged=False))
        staged_runs.append(tcp_bytes_per_s(size, "cpu", staged=True))
        if cuda:
            cuda_runs.append(tcp_bytes_per_s(size, "cuda", staged=True))
    (raw, raw_equal), (cpu, cpu_equal), (staged, staged_equal) = best(raw_runs), best(cpu_runs), best(staged_runs)
    gpu, gpu_equal = best(cuda_runs) if cuda else (None, True)
    ops = read_ops(size, caches(Size(1, size.blocks, 1, 1), "cpu", 0)[0])
    block_bytes = 2 * ops[0][2]
    cuda_text = "n/a (no CUDA here)" if gpu is None else f"{gpu / 1e9:.2f} GB/s (ratio {gpu / raw:.2f})"
    print(f"raw pyzmq {raw / 1e9:.2f} GB/s; tcp: CPU tensors {cpu / 1e9:.2f} GB/s (ratio {cpu / raw:.2f}), ", end="")
    print(f"CPU tensors staged {staged / 1e9:.2f} GB/s (ratio {staged / raw:.2f}), CUDA tensors {cuda_text}")
    print(
        json.dumps(
            {
                "tcp_gb_s_cpu": round(cpu / 1e9, 3),
                "tcp_staged_gb_s_cpu": round(staged / 1e9, 3),
                "raw_zmq_gb_s": round(raw / 1e9, 3),
                "ratio_cpu": round(cpu / raw, 3),
                "ratio_staged_cpu": round(staged / raw, 3),
                "tcp_gb_s_cuda": None if gpu is None else round(gpu / 1e9, 3),
                "ratio_cuda": None if gpu is None else round(gpu / raw, 3),
                "bytes_equal": raw_equal and cpu_equal and staged_equal and gpu_equal,
                "layers": size.layers,
                "blocks": size.blocks,
                "block_bytes": block_bytes,
                "round_bytes": size.layers * size.blocks * block_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
