"""Every built-in task evaluates a model that lives on a GPU (its held-out data goes where the
model is). Skipped where CUDA is absent."""
from __future__ import annotations

import math

import pytest
import torch

from starling.tasks import get_task

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name", ["charlm", "teacher", "quadratic"])
def test_a_task_evaluates_a_model_on_the_gpu(name: str) -> None:
    task = get_task(name)
    model = task.make_model().cuda()
    metrics = task.evaluate(model)
    assert math.isfinite(metrics["eval_loss"])
    assert next(model.parameters()).is_cuda
