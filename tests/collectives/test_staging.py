"""Pinned host staging: a no-op on the CPU (the path CI runs), reused pinned buffers on CUDA."""
from __future__ import annotations

import pytest
import torch

from starling.collectives.staging import HostStaging, to_device
from starling.compressors import decode, from_spec

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_packets_pass_through_untouched():
    packet = from_spec("int4").encode(torch.randn(100))
    staging = HostStaging()
    staged, lent = staging.stage(packet)
    assert staged is packet and lent == [] and staging.allocated == 0
    staging.ready([torch.device("cpu")])
    assert to_device(packet, torch.device("cpu")) is packet


@cuda
def test_device_packets_cross_through_reused_pinned_buffers():
    staging, codec = HostStaging(), from_spec("int4")
    x = torch.randn(10_000, device="cuda")
    packet = codec.encode(x)
    staged, lent = staging.stage(packet)
    staging.ready([x.device])
    assert lent and all(b.is_pinned() and b.device.type == "cpu" for b in staged.buffers)
    assert torch.equal(decode(staged), decode(packet).cpu())
    allocated = staging.allocated
    staging.give_back(lent)
    again, lent2 = staging.stage(codec.encode(x * 2))
    assert staging.allocated == allocated  # the same buffers, reused
    assert {b.data_ptr() for b in lent2} == {b.data_ptr() for b in lent}
    back = to_device(again, x.device)
    assert all(b.device == x.device for b in back.buffers)
    assert torch.equal(decode(back), decode(codec.encode(x * 2)))
