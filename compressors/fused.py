"""Codec kernels compiled into one pass over the tensor on accelerators.

On a GPU an eager block quantizer is a chain of whole-tensor passes (block max and min, scale,
round, cast, pack), each of which reads and writes device memory, where a copy of the tensor is
one pass. ``torch.compile`` (Inductor, which writes Triton kernels on CUDA) fuses such a chain
into a kernel that reads each value once and writes only the codes and the block scales.

``Fused(fn)`` wraps a function of tensors whose first argument is the input:

- on the CPU it runs ``fn`` eagerly: compiling there builds C++ for seconds per codec, and the
  CPU codecs keep their own cache-sized loops;
- on an accelerator it runs ``fn`` compiled (one graph, the first dimension dynamic, division
  rounded as eager rounds it). The first call for each kind of input (device, dtype, block)
  starts the compile in a thread and runs eagerly, as do the calls until the kernel is ready:
  compiling takes seconds, and a codec's first call is in a round that its peers wait on;
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


_COMPILING = threading.Lock()


class Fused:
    """``fn`` compiled on accelerators, eager on the CPU (see the module's docstring)."""

    kernels: ClassVar[list[Fused]] = []  # every one made, for reports of which ran compiled
    eager_devices: ClassVar[frozenset[str]] = frozenset({"cpu"})  # device types that never compile
    backend: ClassVar[str] = "inductor"  # torch.compile's backend ("eager" traces without code generation: tests)

    def __init__(self, fn: Callable[..., Any]) -> None:
        Fused.kernels.append(self)
        self.fn = fn
        self.compiled_calls = 0  # calls that ran the compiled kernel (the CUDA tests read it)
        self.failure: str | None = None  # why compiling was given up, once it was
        self._compiled: Callable[..., Any] | None = None
        self._ready: dict[tuple[Any, ...], threading.Event] = {}  # per kind of input: set once compiled
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def __call__(self, x: torch.Tensor, *args: Any) -> Any:
        # one block is left eager: a dimension of size 1 is a constant to the compiler, and the
        # kernel built for it would be built again for every other size
        if x.device.type in self.eager_devices or x.dim() == 0 or x.shape[0] < 2 or self.failure is not None \
                or not compiling_enabled():
            return self.fn(x, *args)
        key = (x.device, x.dtype, tuple(x.shape[1:]), args)
        with self._lock:
            ready = self._ready.get(key)
            if ready is None:
                self._ready[key] = ready = threading.Event()
                self._start(ready, x[:2].clone(), args)
        if not ready.is_set() or self.failure is not None:
            return self.fn(x, *args)
        try:
            out = self._kernel(None)(x, *args)
        except Exception as exc:
            out = self.fn(x, *args)  # raises too where the input, not the compiler, is at fault
            self._give_up(exc, x.device)
            return out
        self.compiled_calls += 1
        return out

    def _start(self, ready: threading.Event, sample: torch.Tensor, args: tuple[Any, ...]) -> None:
        """Compile for inputs like ``sample`` in a thread; calls run eagerly until it is done.
        Compiling takes seconds, and a codec's first call is in a round that peers wait on."""

        # The compiler's modules are imported here, in the caller's thread: two threads importing
        # torch._dynamo at once can meet a partly initialised module.
        import torch._dynamo  # noqa: F401

        try:
            options = _eager_division() if self.backend == "inductor" else {}
        except RuntimeError as exc:
            self._give_up(exc, sample.device)
            ready.set()
            return

        def compile_kernel() -> None:
            try:
                with _COMPILING:  # one compile at a time, whichever kernel
                    self._kernel(options)(sample, *args)
            except Exception as exc:
                try:
                    self.fn(sample, *args)
                except Exception:
                    pass  # the function fails on this input eagerly too: not the compiler's fault
                else:
                    self._give_up(exc, sample.device)
            finally:
                ready.set()

        thread = threading.Thread(target=compile_kernel, name=f"compile-{self.fn.__name__}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _give_up(self, exc: BaseException, device: torch.device) -> None:
        self.failure = f"{type(exc).__name__}: {exc}"
        log.warning("codec kernel %s runs eagerly on %s from now on: compiling failed (%s)",
                    self.fn.__name__, device, self.failure[:300])

    @classmethod
    def settle(cls, timeout_s: float | None = None) -> None:
        """Wait for the compiles under way (benchmarks and tests, before they time a kernel)."""
        for kernel in cls.kernels:
            for thread in list(kernel._threads):
                thread.join(timeout_s)

    @classmethod
    def report(cls) -> dict[str, Any]:
        """Calls that ran compiled, summed over every kernel, and each given-up kernel's reason."""
        return {"compiled_calls": sum(k.compiled_calls for k in cls.kernels),
                "failures": {k.fn.__name__: k.failure for k in cls.kernels if k.failure is not None}}

    def _kernel(self, options: dict[str, bool] | None) -> Callable[..., Any]:
        with self._lock:
            if self._compiled is None:
                if options is None:
                    options = _eager_division() if self.backend == "inductor" else {}
                compiled = torch.compile(self.fn, fullgraph=True, backend=self.backend,
                                         **({"options": options} if options else {}))

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
