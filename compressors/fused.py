"""Codec kernels compiled into one pass over the tensor on accelerators.

On a GPU an eager block quantizer is a chain of whole-tensor passes (block max and min, scale,
round, cast, pack), each of which reads and writes device memory, where a copy of the tensor is
one pass. ``torch.compile`` (Inductor, which writes Triton kernels on CUDA) fuses such a chain
into a kernel that reads each value once and writes only the codes and the block scales.

``Fused(fn)`` wraps a function of tensors whose first argument is the input:

- on the CPU it runs ``fn`` eagerly: compiling there builds C++ for seconds per codec, and the
  CPU codecs keep their own cache-sized loops;
- on an accelerator it runs ``fn`` compiled (one graph, the first dimension dynamic, division
  rounded as eager rounds it), compiling on first use;
- where the compiled call fails and the eager one on the same input does not (no Triton, an op
  the compiler lacks, an old torch), it logs one warning and runs ``fn`` eagerly from then on.

The compiled kernel keeps the eager function's operations in their order, so both write the
same bytes (the CUDA tests check it). ``STARLING_COMPILE_CODECS=0`` turns compiling off.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch

log = logging.getLogger(__name__)

ENV = "STARLING_COMPILE_CODECS"


def compiling_enabled() -> bool:
    """False when the environment turns compiled codec kernels off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class Fused:
    """``fn`` compiled on accelerators, eager on the CPU (see the module's docstring)."""

    kernels: ClassVar[list[Fused]] = []  # every one made, for reports of which ran compiled

    def __init__(self, fn: Callable[..., Any]) -> None:
        Fused.kernels.append(self)
        self.fn = fn
        self.compiled_calls = 0  # calls that ran the compiled kernel (the CUDA tests read it)
        self.failure: str | None = None  # why compiling was given up, once it was
        self._compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def __call__(self, x: torch.Tensor, *args: Any) -> Any:
        if x.device.type == "cpu" or self.failure is not None or not compiling_enabled():
            return self.fn(x, *args)
        try:
            out = self._kernel()(x, *args)
        except Exception as exc:
            out = self.fn(x, *args)  # raises too where the input, not the compiler, is at fault
            self.failure = f"{type(exc).__name__}: {exc}"
            log.warning("codec kernel %s runs eagerly on %s from now on: compiling failed (%s)",
                        self.fn.__name__, x.device, self.failure[:300])
            return out
        self.compiled_calls += 1
        return out

    @classmethod
    def report(cls) -> dict[str, Any]:
        """Calls that ran compiled, summed over every kernel, and each given-up kernel's reason."""
        return {"compiled_calls": sum(k.compiled_calls for k in cls.kernels),
                "failures": {k.fn.__name__: k.failure for k in cls.kernels if k.failure is not None}}

    def _kernel(self) -> Callable[..., Any]:
        with self._lock:
            if self._compiled is None:
                compiled = torch.compile(self.fn, fullgraph=True, options=_eager_division())

                def kernel(*args: Any) -> Any:
                    # Only the count of blocks varies between calls: a block's width stays a
                    # constant of the kernel, which keeps each block's values in registers.
                    for arg in args:
                        if isinstance(arg, torch.Tensor) and arg.dim():
                            torch._dynamo.maybe_mark_dynamic(arg, 0)
                    return compiled(*args)

                self._compiled = kernel
            return self._compiled


def _eager_division() -> dict[str, bool]:
    """The compiler option that rounds ``a / b`` as eager torch does (IEEE), under the name this
    torch gives it. Triton's plain division is approximate to 2 ulp, which moves a value across
    a rounding boundary now and then: the codes would differ from the CPU's. A torch that has no
    such option gets no compiled kernels."""
    import torch._inductor.config as inductor

    names = inductor.get_config_copy()
    for name in ("eager_numerics.division_rounding", "emulate_divison_rounding", "emulate_division_rounding"):
        if name in names:
            return {name: True}
    raise RuntimeError(f"torch {torch.__version__}'s compiler cannot round division as eager does")
