"""K/V between the device and host memory on a side stream (CUDA), so a tier's copy never waits behind, or holds
up, a decode step.

Down (a session leaving the pool): its blocks are gathered on the compute stream (they must be read after the
step that wrote them), then copied into pinned host memory on the side stream, which waits for that gather
only; the snapshot carries the copy's event, and whoever reads its host tensors (the disk writer, a restore)
waits for it. Up (a session coming back from host RAM, disk or Redis): on the loader thread its host tensors
are staged in pinned memory and copied to the device on the side stream; the engine thread's restore makes
the compute stream wait for that copy's event (on the device: the host thread never blocks) before writing the
K/V into the pool's blocks. Decode steps run on the compute stream meanwhile.

The device calls are `CudaOps`; `Transfers` holds the order they are made in, which the tests check on a CPU
with a recording stand-in. Each pool has its own (`KVPool.transfers`). Without CUDA nothing is copied (the
pool is in host memory already).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class DeviceOps(Protocol):
    def side_waits_for_compute(self) -> None: ...
    def on_side(self) -> Any: ...  # a context manager: work issued inside runs on the side stream
    def pinned_like(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def empty_on_device(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def keep_for_side(self, tensor: torch.Tensor) -> None: ...
    def keep_for_compute(self, tensor: torch.Tensor) -> None: ...
    def side_done(self) -> Any: ...  # an event marking what the side stream was given so far
    def compute_waits(self, event: Any) -> None: ...


class CudaOps:
    """The CUDA calls: one side stream per device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def side_waits_for_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def on_side(self) -> Any:
        return torch.cuda.stream(self.stream)

    def pinned_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def empty_on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)

    def keep_for_side(self, tensor: torch.Tensor) -> None:
        """A device tensor the side stream reads: not reused by the allocator before the side stream is done."""
        tensor.record_stream(self.stream)

    def keep_for_compute(self, tensor: torch.Tensor) -> None:
        """A device tensor made on the side stream that the compute stream reads."""
        tensor.record_stream(torch.cuda.current_stream(self.device))

    def side_done(self) -> Any:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def compute_waits(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)


class Transfers:
    """Side-stream copies for one device (see the module's docstring); `ops` None: a CPU pool, nothing to copy."""

    def __init__(self, ops: DeviceOps | None) -> None:
        self.ops = ops

    def to_host(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """Device tensors the compute stream just made -> pinned host copies, and the event of their copy."""
        ops = self.ops
        if ops is None:
            return tensors, None
        ops.side_waits_for_compute()
        hosts = []
        with ops.on_side():
            for tensor in tensors:
                host = ops.pinned_like(tensor)
                host.copy_(tensor, non_blocking=True)
                ops.keep_for_side(tensor)
                hosts.append(host)
        return hosts, ops.side_done()

    def to_device(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        """Host tensors -> device copies through pinned memory: (the device tensors, the pinned ones the copy reads
        until its event, the event)."""
        ops = self.ops
        if ops is None:
            return tensors, [], None
        staged, on_device = [], []
        with ops.on_side():
            for tensor in tensors:
                pinned = tensor if tensor.is_pinned() else ops.pinned_like(tensor).copy_(tensor)
                device = ops.empty_on_device(tensor)
                device.copy_(pinned, non_blocking=True)
                staged.append(pinned)
                on_device.append(device)
        return on_device, staged, ops.side_done()

    def use_on_compute(self, event: Any, tensors: list[torch.Tensor]) -> None:
        """Before the compute stream reads tensors `to_device` made: it waits for their copy (on the device)."""
        ops = self.ops
        if ops is None or event is None:
            return
        ops.compute_waits(event)
        for tensor in tensors:
            ops.keep_for_compute(tensor)


def transfers_for(device: torch.device) -> Transfers:
    """New transfers for a pool on this device: a side stream of its own on CUDA, nothing on a CPU."""
    return Transfers(CudaOps(device) if device.type == "cuda" else None)
