"""starling.common.options: the one NAME=VALUE parser and config coercer."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from starling.common import coerce_option, config_from_options, option_name, parse_bool, parse_options, split_option


@dataclass(frozen=True)
class Config:
    rate: float = 0.1
    count: int = 3
    name: str = "x"
    flag: bool = False
    limit: float | None = None
    batch_size: int = 1
    derived: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError("count must be >= 0")


class CustomError(Exception):
    pass


def test_names_read_dashes_as_underscores() -> None:
    assert option_name(" sync-every ") == "sync_every"
    assert split_option("sync-every = 20") == ("sync_every", "20")
    assert parse_options(["a=1", "b-c= x y ", "a=2", "empty="]) == {"a": "2", "b_c": "x y", "empty": ""}


@pytest.mark.parametrize("text", ["novalue", "=1", " =1"])
def test_pairs_without_a_name_or_sign_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"task option .* is not of the form NAME=VALUE"):
        parse_options([text], "task option")
    with pytest.raises(CustomError, match="NAME=VALUE"):
        split_option(text, error=CustomError)


def test_text_is_read_as_the_field_type() -> None:
    config = config_from_options(Config, {"rate": " 1e-3", "count": "7", "name": "y", "flag": "Yes",
                                          "limit": "2.5"})
    assert config == Config(rate=0.001, count=7, name="y", flag=True, limit=2.5)
    assert config_from_options(Config, {"flag": "off"}).flag is False


def test_typed_values_are_kept_and_ints_are_floats() -> None:
    config = config_from_options(Config, {"rate": 1, "count": 4, "limit": None, "flag": True})
    assert config.rate == 1.0 and isinstance(config.rate, float)
    assert config.count == 4 and config.limit is None and config.flag is True
    assert config_from_options(Config, {"batch-size": 5, "batch_size": 6}).batch_size == 6  # one field
    assert config_from_options(Config, {}) == Config()


@pytest.mark.parametrize(("options", "match"), [
    ({"count": "many"}, "count='many': expected int"),
    ({"count": 6.5}, "count=6.5: expected int"),
    ({"count": True}, "count=True: expected int"),
    ({"rate": False}, "rate=False: expected float"),
    ({"rate": "fast"}, "rate='fast': expected float"),
    ({"flag": "maybe"}, "flag='maybe': expected bool"),
    ({"flag": 1}, "flag=1: expected bool"),
    ({"name": 3}, "name=3: expected str"),
    ({"count": None}, "count=None: expected int"),
])
def test_bad_values_name_the_field(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config_from_options(Config, options)
    with pytest.raises(CustomError, match=match):
        config_from_options(Config, options, error=CustomError)


def test_unknown_names_are_listed_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown option 'speed' for Config; known options: rate, count, name"):
        config_from_options(Config, {"speed": 1})
    with pytest.raises(CustomError, match=r"unknown options 'a', 'b-c'"):
        config_from_options(Config, {"a": 1, "b-c": 2, "rate": 1}, error=CustomError)
    with pytest.raises(ValueError, match="'derived'"):  # not an init field: not an option
        config_from_options(Config, {"derived": 1})


def test_the_configs_own_checks_keep_or_take_the_callers_error_type() -> None:
    with pytest.raises(ValueError, match="^count must be >= 0$"):  # already the caller's type: as it is
        config_from_options(Config, {"count": -1})
    with pytest.raises(CustomError, match="^Config: count must be >= 0$"):
        config_from_options(Config, {"count": -1}, error=CustomError)


def test_other_kinds_pass_as_they_are() -> None:
    assert coerce_option("x", "text", tuple) == "text"
    assert coerce_option("x", [1], int | str) == [1]
    assert coerce_option("x", "3", int | None) == 3


def test_frozen_result() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        config_from_options(Config, {}).count = 1  # type: ignore[misc]


def test_one_set_of_bool_words() -> None:
    assert [parse_bool(w) for w in ("1", "true", " Yes", "ON")] == [True] * 4
    assert [parse_bool(w) for w in ("0", "False", "no ", "off")] == [False] * 4
    with pytest.raises(ValueError, match="expected a boolean"):
        parse_bool("perhaps")
