"""Task lookup by name: the built-in tasks, a Hugging Face causal LM (``hf:NAME``), or a user's
``module:callable`` factory."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .base import Task
from .charlm import CharLMTask
from .hf import PREFIX as HF_PREFIX
from .hf import HFCausalLMTask
from .quadratic import QuadraticTask
from .teacher import TeacherTask
from .textlm import TextLMTask

DEFAULT_TASK = "charlm"

_BUILTIN: dict[str, type[Task]] = {
    CharLMTask.name: CharLMTask,
    TeacherTask.name: TeacherTask,
    QuadraticTask.name: QuadraticTask,
    TextLMTask.name: TextLMTask,
}


class TaskSpecError(ValueError):
    """A task spec or its options could not be turned into a Task."""


def registered_tasks() -> list[str]:
    """Names of the built-in tasks, sorted."""
    return sorted(_BUILTIN)


def get_task(spec: str = DEFAULT_TASK, **options: Any) -> Task:
    """A task from a built-in name (``"charlm"``), ``"hf:NAME"`` (a `transformers` causal LM
    from a local folder or a hub name, `tasks/hf.py`) or a ``"module:callable"`` factory.

    Built-in tasks take `options` as overrides of their config dataclass (typed values or
    strings); a factory is called with `options` as keyword arguments and must return a Task.
    ``hf:`` always means the built-in task, never a module named ``hf``.
    Raises TaskSpecError (a ValueError) for an unknown name, option or bad value.
    """
    spec = spec.strip()
    if spec.startswith(HF_PREFIX):
        try:
            return HFCausalLMTask.for_spec(spec, **options)
        except ValueError as e:
            raise TaskSpecError(f"task {spec!r}: {e}") from e
    if ":" in spec:
        return _load_factory(spec, options)
    task_class = _BUILTIN.get(spec)
    if task_class is None:
        raise TaskSpecError(
            f"unknown task {spec!r}; known tasks: {', '.join(registered_tasks())} "
            "(or 'hf:NAME' for a Hugging Face causal LM, 'module:callable' for your own)"
        )
    try:
        return task_class.from_options(**options)
    except ValueError as e:
        raise TaskSpecError(f"task {spec!r}: {e}") from e


def _load_factory(spec: str, options: dict[str, Any]) -> Task:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise TaskSpecError(f"task spec {spec!r} is not of the form 'module:callable'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskSpecError(f"task {spec!r}: cannot import module {module_name!r}: {e}") from e
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise TaskSpecError(f"task {spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(target):
        raise TaskSpecError(f"task {spec!r}: {attr_path!r} is not callable")
    factory: Callable[..., Any] = target
    try:
        task = factory(**options)
    except TypeError as e:
        raise TaskSpecError(f"task {spec!r}: factory rejected options {sorted(options)}: {e}") from e
    if not isinstance(task, Task):
        raise TaskSpecError(
            f"task {spec!r}: factory returned {type(task).__name__}, not a starling.tasks.Task"
        )
    return task
