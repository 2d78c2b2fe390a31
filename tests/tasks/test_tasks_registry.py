from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from starling.tasks import (
    CharLMConfig,
    CharLMTask,
    QuadraticTask,
    Task,
    TaskSpecError,
    TeacherTask,
    derive_seed,
    get_task,
    parse_options,
    registered_tasks,
)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    # Like the simulator: on a busy 2-core box, torch's intra-op thread pool stalls for seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def user_module_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_registered_tasks() -> None:
    assert registered_tasks() == ["charlm", "gpt", "quadratic", "teacher"]


@pytest.mark.parametrize(
    ("name", "cls"), [("charlm", CharLMTask), ("teacher", TeacherTask), ("quadratic", QuadraticTask)]
)
def test_get_builtin(name: str, cls: type[Task]) -> None:
    task = get_task(name)
    assert type(task) is cls and task.name == name
    assert task.config == cls.config_class()


def test_default_is_charlm() -> None:
    assert isinstance(get_task(), CharLMTask)


def test_unknown_task_lists_known() -> None:
    with pytest.raises(ValueError, match="unknown task 'gpt9'.*charlm, gpt, quadratic, teacher"):
        get_task("gpt9")


def test_unknown_option_is_named() -> None:
    with pytest.raises(ValueError, match="'sequence_length'.*known options:.*seq_len"):
        get_task("charlm", sequence_length=3)


def test_string_options_are_typed() -> None:
    task = get_task("charlm", seq_len="32", tie_weights="false", eval_fraction="0.2")
    assert task.config.seq_len == 32
    assert task.config.tie_weights is False
    assert task.config.eval_fraction == 0.2
    assert get_task("teacher", non_iid=1).config.non_iid == 1.0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"seq_len": "sixty"}, "seq_len='sixty': expected int"),
        ({"seq_len": 6.5}, "seq_len=6.5: expected int"),
        ({"seq_len": True}, "seq_len=True: expected int"),
        ({"tie_weights": "maybe"}, "tie_weights='maybe': expected bool"),
        ({"n_head": 3}, "divisible by n_head"),
        ({"eval_fraction": 1.5}, "eval_fraction must be in"),
    ],
)
def test_bad_option_values(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_task("charlm", **options)


def test_bad_values_other_tasks() -> None:
    with pytest.raises(ValueError, match="non_iid must be in"):
        get_task("teacher", non_iid=1.5)
    with pytest.raises(ValueError, match="condition_number must be >= 1"):
        get_task("quadratic", condition_number=0.5)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CharLMConfig().seq_len = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["charlm", "teacher", "quadratic"])
def test_describe_round_trips(name: str) -> None:
    description = get_task(name).describe()
    assert description["name"] == name
    assert get_task(description["name"], **description["config"]).describe() == description


def test_describe_differs_by_config() -> None:
    assert get_task("charlm").describe() != get_task("charlm", seq_len=32).describe()


def test_parse_options() -> None:
    assert parse_options(["seq_len=64", " non_iid = 0.5 "]) == {"seq_len": "64", "non_iid": "0.5"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_options(["seq_len"])


def test_module_callable(user_module_on_path: None) -> None:
    task = get_task("tasks_user_example:make_task", dim="3")
    assert isinstance(task, Task) and task.dim == 3
    assert task.describe() == {"name": "user-linear", "config": {"dim": 3}}
    model = task.make_model()
    loss = task.loss(model, next(task.batches(0, 2, 0)))
    assert loss.ndim == 0


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("tasks_user_example:missing", "has no attribute 'missing'"),
        ("tasks_user_example:NOT_CALLABLE", "is not callable"),
        ("tasks_user_example:not_a_task", "returned object, not a starling.tasks.Task"),
        (":make", "not of the form 'module:callable'"),
    ],
)
def test_module_callable_errors(user_module_on_path: None, spec: str, match: str) -> None:
    with pytest.raises(TaskSpecError, match=match):
        get_task(spec)


def test_module_callable_rejects_options(user_module_on_path: None) -> None:
    with pytest.raises(TaskSpecError, match="rejected options"):
        get_task("tasks_user_example:make_task", width=3)


def test_derive_seed_separates_streams() -> None:
    assert derive_seed("x", 0, 1) == derive_seed("x", 0, 1)
    assert derive_seed("x", 0, 1) != derive_seed("x", 1, 0)
    assert derive_seed("x", 0, 1) != derive_seed("y", 0, 1)
    assert 0 <= derive_seed("x", -5) < 2**63
