"""What a swarm trains: `TrainSpec` (protocol, its options, task, seed, whose data), and the one
reading of protocol names and options into a protocol's class and config.

A swarm trains either one corpus (data scope `swarm`, the default: the swarm's config names the
data, and its ledger hands each member units of it) or each member's own (data scope `local`,
as federated learning does: the config names no data, every member trains its own `--data`
in epochs of its own, and averages weigh each member by what it trained). In a local swarm the
config fixes only what must agree for the members' updates to mean the same: the task and its
model options, the sequence length, and the tokenizer, by the fingerprint of its content.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starling.common import option_name
from starling.protocols import Protocol, ProtocolError, config_from_options, get_protocol
from starling.tasks import get_task

__all__ = ["DATA_SCOPES", "DATA_SCOPE_KEY", "LOCAL_DATA_OPTIONS", "RUN_LENGTH_OPTION", "TOKENIZER_KEY", "TrainSpec",
           "TrainSpecError", "plans_run_length", "protocol_config", "resolve_protocol", "tokenizer_fingerprint",
           "with_run_length"]

# A protocol option that plans for the run's length (sketch-dp's privacy budget is spread over
# it); filled from the run's step count when the user leaves it unset.
RUN_LENGTH_OPTION = "budget_steps"
DATA_SCOPES = ("swarm", "local")
DATA_SCOPE_KEY = "data_scope"  # in the swarm config, beside the spec, when the task reads data
TOKENIZER_KEY = "tokenizer"  # in a local swarm's config: the fingerprint of the members' tokenizer
# task options that name a member's own data rather than what the swarm trains: in a local swarm
# they stay with the member (`TrainSpec.local_options`), out of the swarm's config
LOCAL_DATA_OPTIONS = ("data", "tokenizer", "cache_dir", "text_field", "split", "unit_bytes")


class TrainSpecError(ValueError):
    """A swarm config does not describe something this node can train."""


@dataclass(frozen=True)
class TrainSpec:
    """What a swarm trains: every peer must run the same protocol, options and task."""

    protocol: str
    task: str = "charlm"
    options: Mapping[str, Any] = field(default_factory=dict)  # protocol hyper-parameters
    task_options: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    data_scope: str = "swarm"  # "local": each member trains its own data (`local_options`)
    # a local swarm's member: its own data's task options (LOCAL_DATA_OPTIONS), never in the config
    local_options: Mapping[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None  # a local swarm: the fingerprint of the tokenizer every member uses

    def __post_init__(self) -> None:
        if self.data_scope not in DATA_SCOPES:
            raise TrainSpecError(f"data scope {self.data_scope!r}: expected one of {', '.join(DATA_SCOPES)}")
        if self.data_scope == "swarm" and self.local_options:
            raise TrainSpecError("options of a member's own data go with data scope local")

    @property
    def local(self) -> bool:
        """Whether each member trains its own data."""
        return self.data_scope == "local"

    def task_kwargs(self) -> dict[str, Any]:
        """What this member builds its task with: the swarm's task options and its own data's."""
        return {**self.task_options, **self.local_options}

    def to_swarm_config(self) -> dict[str, Any]:
        config = {"protocol": self.protocol, "task": self.task, "options": dict(self.options),
                  "task_options": dict(self.task_options), "seed": self.seed}
        if self.local:
            config[DATA_SCOPE_KEY] = self.data_scope
            if self.tokenizer is not None:
                config[TOKENIZER_KEY] = self.tokenizer
        return config

    @classmethod
    def from_swarm_config(cls, config: Mapping[str, Any] | None) -> TrainSpec:
        if not config or not config.get("protocol"):
            raise TrainSpecError("the swarm does not train (its first node was started without --protocol); "
                                 "name a protocol and task to start a training swarm")
        try:
            options, task_options = dict(config.get("options") or {}), dict(config.get("task_options") or {})
            tokenizer = config.get(TOKENIZER_KEY)
            return cls(str(config["protocol"]), str(config.get("task", "charlm")), options, task_options,
                       int(config.get("seed", 0)), str(config.get(DATA_SCOPE_KEY, "swarm")),
                       tokenizer=None if tokenizer is None else str(tokenizer))
        except (TypeError, ValueError) as exc:
            raise TrainSpecError(f"malformed swarm config: {exc}") from None

    def resolved(self) -> dict[str, Any]:
        """The spec with every option parsed into its config (so "0.05" and 0.05 compare equal):
        what two specs must share to train the same swarm."""
        task = get_task(self.task, **self.task_kwargs())
        task_config = getattr(task, "config", None)
        task_options = dataclasses.asdict(task_config) if dataclasses.is_dataclass(task_config) \
            else dict(self.task_kwargs())
        if self.local:  # a member's own data is not what two members must share
            task_options = {k: v for k, v in task_options.items() if k not in LOCAL_DATA_OPTIONS}
        options = dataclasses.asdict(protocol_config(self.protocol, self.options))
        return {"protocol": self.protocol, "task": self.task, "seed": self.seed, "data_scope": self.data_scope,
                "tokenizer": self.tokenizer, "options": options, "task_options": task_options}

    def check(self) -> None:
        """Resolve the protocol, its options and the task now, so that bad input fails
        before training starts (raises ProtocolError or TaskSpecError naming the field)."""
        protocol_config(self.protocol, self.options)
        get_task(self.task, **self.task_kwargs())

    def with_own_data(self, local_options: Mapping[str, Any], tokenizer: str | None = None) -> TrainSpec:
        """This swarm's spec for a member whose own data's options are `local_options`: for a
        local swarm, the member's data and the fingerprint of its tokenizer (`tokenizer`, as
        `NodeLaunch.resolve` found it; None: read from the member's task), checked against the
        swarm's (TrainSpecError in one line: no data, another tokenizer); a swarm of one corpus
        takes none."""
        if not self.local:
            if local_options:
                raise TrainSpecError("this swarm trains one corpus, named in its config (data scope swarm): "
                                     "drop --data-scope local, or start a swarm of its own")
            return self
        if not local_options.get("data"):
            raise TrainSpecError("this swarm trains each member's own data (data scope local): give --data and "
                                 "--data-scope local")
        spec = dataclasses.replace(self, local_options=dict(local_options))
        mine = tokenizer if tokenizer is not None else tokenizer_fingerprint(get_task(spec.task, **spec.task_kwargs()))
        if self.tokenizer is not None and mine != self.tokenizer:
            raise TrainSpecError(f"this member's tokenizer (fingerprint {str(mine)[:12]}) is not the swarm's "
                                 f"({self.tokenizer[:12]}): every member of a local swarm must tokenize alike")
        return spec


def tokenizer_fingerprint(task: Any) -> str | None:
    """The fingerprint of the content of `task`'s tokenizer (None for a task without one)."""
    tokenizer = getattr(task, "tokenizer", None)
    fingerprint = getattr(tokenizer, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None


def resolve_protocol(name: str) -> type[Protocol]:
    """A protocol class by registered name; "module:name" imports `module` first, and a bare
    name not yet registered is looked for in `starling.protocols.<name>`."""
    module, sep, registered = name.rpartition(":")
    if sep:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ProtocolError(f"protocol {name!r}: cannot import {module!r}: {exc}") from None
        return get_protocol(registered)
    try:
        return get_protocol(name)
    except ProtocolError:
        if not name.replace("-", "_").isidentifier():
            raise
        try:
            importlib.import_module(f"starling.protocols.{name.replace('-', '_')}")
        except ModuleNotFoundError:
            raise ProtocolError(f"unknown protocol {name!r}") from None
        return get_protocol(name)


def protocol_config(protocol: str, options: Mapping[str, Any]) -> Any:
    """The config dataclass `protocol` builds from `options`, as every peer's protocol will.

    This is the one reading of protocol options between a command line and the protocol:
    names with dashes or underscores, values typed or as text (``"20"``, ``"yes"``). Everything
    that needs to know what a run's options amount to (its optimizer, its lr, whether they are
    valid) asks this, never the raw mapping. Raises ProtocolError naming the bad field.
    """
    return config_from_options(resolve_protocol(protocol).config_class, options)


def with_run_length(protocol: str, options: Mapping[str, Any], steps: int | None) -> dict[str, Any]:
    """`options`, plus `budget_steps=steps` when the protocol's config has that field and the
    user did not set it, so that whatever the protocol plans over the run fits its length."""
    out = dict(options)
    if steps is None or any(option_name(name) == RUN_LENGTH_OPTION for name in out):
        return out
    if plans_run_length(protocol):
        out[RUN_LENGTH_OPTION] = steps
    return out


def plans_run_length(protocol: str) -> bool:
    """Whether the protocol plans over the run's length (its config has `budget_steps`)."""
    return any(f.name == RUN_LENGTH_OPTION for f in dataclasses.fields(resolve_protocol(protocol).config_class))
