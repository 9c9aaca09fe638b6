"""The KV store of one worker: a device pool and a host pool of paged blocks, and swaps between them.

Block-major pools ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``, so a block swaps in
one copy. Swaps run on a side stream per direction (GPU) or one copy thread (CPU); a step waits only
for those touching its blocks. Which block is whose is ``fastserve.kv``'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastserve import kernels
from fastserve.kernels import huge_pages
from fastserve.worker.messages import SwapCommand
from fastserve.worker.parallel import explicit_device

#: cudaHostRegisterDefault: page-locked, usable by the current device's copies.
CUDA_HOST_REGISTER_DEFAULT = 0


def register_host_memory(pool: torch.Tensor) -> bool:
    """Page-lock ``pool`` in place, exactly its size (``pin_memory=True`` rounds up to a power of
    two); False for an empty pool. ``unregister_host_memory`` must release it before it is freed."""
    nbytes = pool.untyped_storage().nbytes()
    if not nbytes:
        return False
    if not pool.is_contiguous() or pool.device.type != "cpu":
        raise ValueError(f"only a contiguous CPU tensor can be registered, got {pool.device} "
                         f"contiguous={pool.is_contiguous()}")
    err = int(torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), nbytes, CUDA_HOST_REGISTER_DEFAULT))
    if err:
        raise RuntimeError(f"cudaHostRegister of the {nbytes}-byte host KV pool failed (CUDA error {err})")
    return True


def unregister_host_memory(pool: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(pool.data_ptr()))
    if err:
        raise RuntimeError(f"cudaHostUnregister of the host KV pool failed (CUDA error {err})")


def pinned_allocator_bytes(nbytes: int) -> int:
    """What ``pin_memory=True`` reserves for ``nbytes``: the next power of two."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


@dataclass
class SwapHandle:
    """An issued swap: which device and host blocks it touches, and how to wait for it."""

    device_blocks: frozenset[int]
    host_blocks: frozenset[int] = frozenset()
    direction: str = "out"
    job_id: str = ""
    _future: Future[None] | None = None
    _event: torch.cuda.Event | None = None

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()  # re-raises a failed copy here, on the step's thread
        elif self._event is not None:
            self._event.synchronize()


class TimingEvent(Protocol):
    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class DeviceStalls:
    """Compute-stream stalls on swaps: event pairs around each wait, read once the device passed them."""

    def __init__(self) -> None:
        self._pending: list[tuple[TimingEvent, TimingEvent]] = []

    def add(self, before: TimingEvent, after: TimingEvent) -> None:
        self._pending.append((before, after))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def collect_s(self) -> float:
        """Seconds stalled over the pairs the device has passed; those are forgotten."""
        waited_ms, kept = 0.0, []
        for before, after in self._pending:
            if after.query():   # ``after`` done ⇒ ``before`` done (same stream, recorded first)
                waited_ms += before.elapsed_time(after)
            else:
                kept.append((before, after))
        self._pending = kept
        return waited_ms / 1000.0


class KVStore:
    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_device_blocks", num_device_blocks), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.device = explicit_device(device)
        shape = (num_layers, 2, block_size, num_heads, head_dim)
        # Only the device pool is read by every decode step, so only it goes on huge pages.
        self.device_pool = (huge_pages.zeros((num_device_blocks, *shape), dtype) if self.device.type == "cpu"
                            else torch.zeros((num_device_blocks, *shape), dtype=dtype, device=self.device))
        self.host_pool = torch.zeros((num_host_blocks, *shape), dtype=dtype)
        self._registered = self.device.type == "cuda" and register_host_memory(self.host_pool)
        self._inflight: list[SwapHandle] = []
        self._lock = threading.Lock()
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._copier: ThreadPoolExecutor | None = None
        if self.device.type == "cuda":
            self._streams = {d: torch.cuda.Stream(device=self.device) for d in ("out", "in")}
        else:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-swap")
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.device_stalls = DeviceStalls()

    @property
    def num_device_blocks(self) -> int:
        return int(self.device_pool.shape[0])

    @property
    def num_host_blocks(self) -> int:
        return int(self.host_pool.shape[0])

    @property
    def bytes_per_block(self) -> int:
        return int(self.device_pool[0].numel() * self.device_pool.element_size())

    def layer(self, index: int) -> torch.Tensor:
        """Layer ``index``'s cache, ``[num_blocks, 2, block_size, heads, head_dim]`` (a view)."""
        return self.device_pool[:, index]

    def swap(self, cmd: SwapCommand) -> SwapHandle:
        """Start one job's swap: ``out`` copies device ``src_blocks`` to host ``dst_blocks``, ``in`` back."""
        src, dst = cmd.src_blocks, cmd.dst_blocks
        if cmd.direction == "out":
            self._check(src, dst, self.num_device_blocks, self.num_host_blocks, "device", "host")
            self.swapped_out_blocks += len(src)
            handle = SwapHandle(frozenset(src), frozenset(dst), "out", cmd.job_id)
            return self._issue(self.device_pool, self.host_pool, src, dst, handle)
        self._check(src, dst, self.num_host_blocks, self.num_device_blocks, "host", "device")
        self.swapped_in_blocks += len(src)
        return self._issue(self.host_pool, self.device_pool, src, dst,
                           SwapHandle(frozenset(dst), frozenset(src), "in", cmd.job_id))

    @property
    def settles_lazily(self) -> bool:
        """Whether a step may return with swaps still copying (GPU: events order later uses)."""
        return bool(self._streams)

    def swaps_in_flight(self, direction: str = "in") -> frozenset[str]:
        """Jobs with a swap of ``direction`` still copying; never blocks."""
        with self._lock:
            return frozenset(h.job_id for h in self._inflight if h.direction == direction and not h.done())

    def wait_for(self, device_blocks: Iterable[int]) -> float:
        """Wait for the swaps touching ``device_blocks``; seconds the host waited (0 on a GPU: the stream waits)."""
        wanted = frozenset(device_blocks)
        with self._lock:
            touching = [h for h in self._inflight if h.device_blocks & wanted]
        if self._streams:
            events = [h._event for h in touching if h._event is not None and not h._event.query()]
            if events:
                compute = torch.cuda.current_stream(self.device)
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record(compute)
                for event in events:
                    compute.wait_event(event)
                after.record(compute)
                self.device_stalls.add(before, after)
            return 0.0
        return self._wait(touching)

    def device_wait_s(self) -> float:
        """Seconds the compute stream stalled on swaps since the last call; 0 on CPU."""
        return self.device_stalls.collect_s()

    def wait_all(self) -> float:
        with self._lock:
            pending = list(self._inflight)
        return self._wait(pending)

    def close(self) -> None:
        self.wait_all()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        if self._registered:
            unregister_host_memory(self.host_pool)
            self._registered = False

    def _wait(self, handles: list[SwapHandle]) -> float:
        start = time.perf_counter()
        for h in handles:
            h.wait()
        with self._lock:
            self._inflight = [h for h in self._inflight if not h.done()]
        return time.perf_counter() - start

    def _issue(self, src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int],
               handle: SwapHandle) -> SwapHandle:
        if not src_ids:
            return handle
        if self._streams:
            stream = self._streams[handle.direction]
            # Not before the compute that wrote these blocks, nor another direction's copy of them.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with self._lock:
                self._inflight = [h for h in self._inflight if not h.done()]
                crossing = [h._event for h in self._inflight if h.direction != handle.direction
                            and h._event is not None
                            and (h.device_blocks & handle.device_blocks or h.host_blocks & handle.host_blocks)]
            for event in crossing:
                stream.wait_event(event)
            with torch.cuda.stream(stream):
                kernels.copy_blocks(src, dst, src_ids, dst_ids, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            handle._event = event
        else:
            assert self._copier is not None
            handle._future = self._copier.submit(kernels.copy_blocks, src, dst, src_ids, dst_ids)
        with self._lock:
            self._inflight.append(handle)
        return handle

    @staticmethod
    def _check(src: Sequence[int], dst: Sequence[int], n_src: int, n_dst: int, src_name: str,
               dst_name: str) -> None:
        for s, d in zip(src, dst, strict=True):
            if not 0 <= s < n_src:
                raise ValueError(f"{src_name} block {s} out of range [0, {n_src})")
            if not 0 <= d < n_dst:
                raise ValueError(f"{dst_name} block {d} out of range [0, {n_dst})")
        if len(set(dst)) != len(dst):
            raise ValueError(f"a swap writes one {dst_name} block twice: {list(zip(src, dst, strict=True))}")
