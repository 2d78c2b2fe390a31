"""starling.tasks: built-in workloads (model, per-peer data shards, loss, evaluation).

    task = get_task("charlm", seq_len=32)
    model = task.make_model()
    for batch in itertools.islice(task.batches(rank=0, world=4, seed=0), 100):
        task.loss(model, batch).backward()  # ...and an optimizer or protocol step
    task.evaluate(model)  # {"eval_loss": ...}
"""

from __future__ import annotations

from .base import Task, config_from_options, derive_seed, evaluating, make_generator, parse_options
from .charlm import CharLMConfig, CharLMTask
from .gpt import GPT, GPTConfig
from .quadratic import QuadraticConfig, QuadraticModel, QuadraticTask
from .registry import DEFAULT_TASK, TaskSpecError, get_task, registered_tasks
from .teacher import TeacherConfig, TeacherTask

__all__ = [
    "DEFAULT_TASK",
    "GPT",
    "CharLMConfig",
    "CharLMTask",
    "GPTConfig",
    "QuadraticConfig",
    "QuadraticModel",
    "QuadraticTask",
    "Task",
    "TaskSpecError",
    "TeacherConfig",
    "TeacherTask",
    "config_from_options",
    "derive_seed",
    "evaluating",
    "get_task",
    "make_generator",
    "parse_options",
    "registered_tasks",
]
