"""How an accelerator's tensors reach the wire and come back: encode on the device, copy only
the encoded bytes to the host through reused pinned buffers, and move what arrives to the
device once, still encoded, to decode it there.

    staging = HostStaging()
    lent = staging.stage(packet)        # device buffers -> pinned host buffers (non-blocking)
    staging.ready(lent)                 # one wait for all the copies, before the network reads them
    ...                                 # the round runs on the network thread
    staging.give_back(lent)             # the round is over: the buffers serve the next one

On the CPU every call is a no-op that hands back the packet itself: the same code path runs
in CI, with no copy added. Pinned memory exists only beside an accelerator (torch refuses to
allocate it otherwise), which is why nothing is pinned for a CPU tensor.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from starling.compressors import Packet


class HostStaging:
    """A pool of pinned host buffers, by size, reused from round to round."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self.allocated = 0  # pinned bytes this pool holds (for tests and reports)

    @staticmethod
    def needed(tensor: torch.Tensor) -> bool:
        return tensor.device.type != "cpu"

    def stage(self, packet: Packet) -> tuple[Packet, list[torch.Tensor]]:
        """The packet with its device buffers copied into pinned host buffers (started, not
        waited for: call `ready`), and the buffers lent for it."""
        if not any(self.needed(b) for b in packet.buffers):
            return packet, []
        lent: list[torch.Tensor] = []
        buffers = []
        for b in packet.buffers:
            if not self.needed(b):
                buffers.append(b)
                continue
            host = self._take(b.numel())
            host.copy_(b.reshape(-1), non_blocking=True)
            lent.append(host)
            buffers.append(host)
        return Packet(packet.header, tuple(buffers)), lent

    def ready(self, devices: Sequence[torch.device]) -> None:
        """Wait for the copies started on these devices' current streams."""
        for device in {d for d in devices if d.type != "cpu"}:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            elif device.type == "mps":
                torch.mps.synchronize()

    def give_back(self, lent: Sequence[torch.Tensor]) -> None:
        for host in lent:
            self._free.setdefault(host.numel(), []).append(host)

    def _take(self, nbytes: int) -> torch.Tensor:
        pool = self._free.get(nbytes)
        if pool:
            return pool.pop()
        self.allocated += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def to_device(packet: Packet, device: torch.device) -> Packet:
    """The packet with its (encoded) buffers on `device`, to decode there: the bytes cross
    once, compressed, instead of the decoded float32 values."""
    if device.type == "cpu":
        return packet
    return Packet(packet.header, tuple(b.to(device) for b in packet.buffers))
