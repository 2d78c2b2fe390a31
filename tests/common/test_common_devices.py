"""`--device`, `--dtype`, `--autocast`: parsed once, refused with the choices, and batches of
any shape moved to the model's device."""
from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from starling.common.devices import DeviceError, resolve_autocast, resolve_device, resolve_dtype, to_device


def test_cpu_and_auto_resolve_here():
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("spec, message", [
    ("tpu", "unknown device 'tpu'; choose cpu | cuda | cuda:N | mps | auto"),
    ("cuda:x", "unknown device"),
    ("cuda:99", "cuda:99"),
])
def test_bad_devices_are_refused_with_the_choices(spec, message):
    with pytest.raises(DeviceError, match=message):
        resolve_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda_says_so():
    with pytest.raises(DeviceError, match="this machine has no CUDA device"):
        resolve_device("cuda")


def test_dtypes_and_autocast():
    assert resolve_dtype(None) is torch.float32
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    with pytest.raises(DeviceError, match="choose float32, bfloat16 or float16"):
        resolve_dtype("int8")
    assert resolve_autocast(None) is None and resolve_autocast("none") is None
    assert resolve_autocast("bfloat16") is torch.bfloat16
    with pytest.raises(DeviceError, match="loss scaling"):
        resolve_autocast("fp16")


def test_to_device_moves_every_tensor_and_keeps_the_shape_of_the_batch():
    Pair = namedtuple("Pair", "x y")
    x, y = torch.ones(2), torch.zeros(3, dtype=torch.long)
    batch = {"pair": Pair(x, y), "list": [x, "label", 3], "nested": ({"y": y},)}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["pair"], Pair) and moved["pair"].x is x  # already there: no copy
    assert moved["list"][1:] == ["label", 3] and moved["nested"][0]["y"] is y
    meta = to_device(batch, torch.device("meta"))
    assert meta["pair"].x.device.type == "meta" and meta["nested"][0]["y"].device.type == "meta"
    assert meta["list"][0].device.type == "meta" and meta["list"][1] == "label"
