"""Where a peer computes, and in what precision: one parser for `--device`, `--dtype` and
`--autocast`, and the one function that moves a batch to the model's device.

    resolve_device("auto")    cuda if there is one, else mps, else cpu
    resolve_device("cuda:1")  that device, or DeviceError if this machine has no such device
    resolve_dtype("bf16")     torch.bfloat16 (float32 | bfloat16 | float16, and short names)
    to_device(batch, device)  every tensor inside tuples, lists and dicts moved; others as they are

A device is a per-peer choice, not the swarm's: a swarm may mix a GPU peer with a CPU one.
So is the parameter dtype; the protocols keep what peers exchange (outer parameters,
momentum, averages) in float32 whatever the model's dtype.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

DEVICE_CHOICES = "cpu | cuda | cuda:N | mps | auto"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
# Autocast computes in a lower precision over float32 parameters. float16 autocast needs loss
# scaling (gradients underflow in float16), which the protocols' backward does not do, so only
# bfloat16 is offered; float16 parameters (`--dtype float16`) are the user's explicit choice.
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"none": None, "off": None, "bfloat16": torch.bfloat16,
                                                  "bf16": torch.bfloat16}


class DeviceError(ValueError):
    """A device or dtype this machine or this runtime cannot use, named with the choices."""


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """The torch device for `spec` (None means cpu), checked to exist on this machine."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = (spec or "cpu").strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise DeviceError(f"unknown device {spec!r}; choose {DEVICE_CHOICES}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r}: this machine has no CUDA device (torch {torch.__version__}, "
                              f"cuda build: {torch.version.cuda or 'none'}); use --device cpu or auto")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if not 0 <= index < count:
            raise DeviceError(f"device {spec!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return torch.device("cuda", index)
    if device.type == "mps":
        if not _mps_available():
            raise DeviceError(f"device {spec!r}: MPS is not available on this machine; use --device cpu or auto")
        return torch.device("mps")
    raise DeviceError(f"unsupported device {spec!r}; choose {DEVICE_CHOICES}")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_dtype(spec: str | torch.dtype | None) -> torch.dtype:
    """The parameter dtype for `spec` (None means float32)."""
    if isinstance(spec, torch.dtype):
        if spec in DTYPES.values():
            return spec
        raise DeviceError(f"unsupported parameter dtype {spec}; choose float32, bfloat16 or float16")
    text = (spec or "float32").strip().lower().removeprefix("torch.")
    if text not in DTYPES:
        raise DeviceError(f"unknown dtype {spec!r}; choose float32, bfloat16 or float16")
    return DTYPES[text]


def resolve_autocast(spec: str | torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype for `spec` (None or "none": no autocast)."""
    if spec is None or isinstance(spec, torch.dtype):
        if spec in (None, torch.bfloat16):
            return spec
        raise DeviceError(f"unsupported autocast dtype {spec}; choose none or bfloat16")
    text = spec.strip().lower().removeprefix("torch.")
    if text not in AUTOCAST_DTYPES:
        why = ""
        if text in ("float16", "fp16", "half"):
            why = (" (float16 autocast needs loss scaling, which the protocols' backward does not do; "
                   "use bfloat16, or --dtype float16 for float16 parameters)")
        raise DeviceError(f"unknown autocast dtype {spec!r}; choose none or bfloat16{why}")
    return AUTOCAST_DTYPES[text]


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (inside tuples, lists and dicts, at any depth) on
    `device`; a batch already there is returned as it is. Copies from pinned memory are
    non-blocking; the model's first use of the tensor orders after the copy on its stream."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple keeps its type
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that is not built from a dict
            return moved
    return batch


def to_model_device(batch: Any, model: torch.nn.Module) -> Any:
    """`batch` on the device of the model's first parameter (as it is for a model with none):
    where a task's evaluation and a trainer's steps put what they feed the model."""
    first = next(model.parameters(), None)
    return batch if first is None else to_device(batch, first.device)
