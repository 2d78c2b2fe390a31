"""What every command group shares: one-line failures, logging, and protocol options on the
command line.

Every expected failure (bad address, unreadable key, unreachable peer) is one clear line on
stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import typer
from typer.core import TyperGroup

try:  # typer vendors click since 0.2x; older ones use click itself
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[no-redef]

from starling.common import option_name, parse_options
from starling.node.address import AddressError
from starling.node.identity import KeyFileError
from starling.node.security import SecurityError

EXPECTED_ERRORS = (AddressError, KeyFileError, SecurityError, OSError, ValueError, TimeoutError)

# Commands that train take any other --NAME VALUE as a protocol hyper-parameter.
EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
EXTRA_HELP = ("Any other --NAME VALUE is a hyper-parameter of the protocol (a field of its config; "
              "`starling protocols NAME` lists them), e.g. --sync-every 20 --fragments 4.")


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"starling: error: {message}", err=True)
    raise typer.Exit(code)


class OneLineErrors(TyperGroup):
    """The `starling` group: a usage error (a bad value, a missing argument, an unknown
    option) is one line on stderr, like every other failure, and exit status 2, instead of
    a usage box. `--help`, and a command given no arguments, still print the help."""

    def main(self, args: Optional[Any] = None, prog_name: Optional[str] = None,  # type: ignore[override]
             complete_var: Optional[str] = None, standalone_mode: bool = True, **extra: Any) -> Any:
        click_style_metavars(self)
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except ClickException as exc:
            where = f" (see: {exc.ctx.command_path} --help)" if getattr(exc, "ctx", None) is not None else ""
            message = " ".join(exc.format_message().split())  # one line, whatever the message
            typer.echo(f"starling: error: {message}{where}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("starling: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


# Option types as Click (and Typer before 0.2x) print them; this Typer prints "<int>".
_METAVARS = {"int": "INTEGER", "float": "FLOAT", "str": "TEXT", "path": "PATH", "Path": "PATH",
             "list[str]": "TEXT", "list[Path]": "PATH", "int range": "INTEGER RANGE", "float range": "FLOAT RANGE"}


def click_style_metavars(command: Any) -> None:
    """Give every option of `command` and its subcommands the metavar Click users expect
    (INTEGER, FLOAT, TEXT, PATH), and none to a flag, unless the option names its own."""
    for param in getattr(command, "params", ()):
        if getattr(param, "param_type_name", "") == "argument" and not getattr(param, "_starling_type", None):
            try:  # an argument's metavar is its name in the help; only its type column changes
                label = param.display_type(None).strip("<>")
            except Exception:
                continue
            param._starling_type = _METAVARS.get(label, label.upper())
            param.display_type_rich = lambda ctx, label=param._starling_type: label
            continue
        if getattr(param, "param_type_name", "") != "option" or param.metavar is not None:
            continue
        if getattr(param, "is_flag", False):
            param.metavar = ""
            continue
        try:
            label = param.display_type(None).strip("<>")
        except Exception:  # a type this mapping does not know keeps Typer's own label
            continue
        param.metavar = _METAVARS.get(label, label.upper())
    if not getattr(command, "_starling_help_metavar", False) and hasattr(command, "get_help_option"):
        plain = command.get_help_option

        def help_option(ctx: Any, plain: Any = plain) -> Any:
            option = plain(ctx)
            if option is not None:
                option.metavar = ""  # --help is a flag
            return option

        command.get_help_option = help_option
        command._starling_help_metavar = True
    for sub in getattr(command, "commands", {}).values():
        click_style_metavars(sub)


def device_option(whose: str) -> Any:
    """`--device`, for `whose` model ("this peer's", "every peer's")."""
    return typer.Option(None, "--device", help=f"cpu, cuda, cuda:N, mps or auto: where {whose} model and batches go "
                                               "(default: as the task builds it). A swarm may mix devices.")


def dtype_option() -> Any:
    return typer.Option(None, "--dtype", help="float32, bfloat16 or float16: the model's parameters (what peers "
                                              "exchange stays float32).")


def autocast_option() -> Any:
    return typer.Option(None, "--autocast", help="none or bfloat16: the loss under autocast.")


def state_device_option() -> Any:
    return typer.Option(None, "--state-device", help="model or cpu: where DiLoCo keeps its outer parameters and "
                                                     "momentum (cpu: pinned host memory beside a GPU).")


def check_seconds(flag: str, value: float) -> float:
    """A duration flag's value: finite and > 0, else ValueError naming the flag."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a positive, finite number of seconds, got {value:g}")
    return value


MAX_JSON_DEPTH = 64  # deeper parts of what is printed become "<too deep>"


def json_text(value: Any) -> str:
    """One line of JSON for any value, a remote node's answer included: parts JSON cannot
    hold (nesting past MAX_JSON_DEPTH, keys that are not text, NaN, other types) are written
    as text instead of raising."""
    return json.dumps(_plain(value, MAX_JSON_DEPTH), allow_nan=False)


def _plain(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list, tuple)) and depth <= 0:
        return "<too deep>"
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _plain(v, depth - 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth - 1) for v in value]
    return str(value)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def protocol_options(pairs: Optional[Sequence[str]], args: Sequence[str], **flags: Any) -> dict[str, Any]:
    """The protocol options one command line gives, keyed by field name: the --opt NAME=VALUE
    `pairs`, then every other --NAME VALUE in `args` (what typer left over), then the `flags`
    given (--lr, --compressor; None: not given). A later one wins. Values stay as given, text
    from the line: the protocol's config reads them (`starling.runtime.protocol_config`)."""
    options: dict[str, Any] = {**parse_options(pairs or [], "protocol option"), **extra_options(args)}
    options.update({option_name(name): value for name, value in flags.items() if value is not None})
    return options


def extra_options(args: Sequence[str]) -> dict[str, Any]:
    """Protocol hyper-parameters given as --name VALUE, --name=VALUE or a bare --flag (true)."""
    options: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected argument {arg!r}")
        name, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"
        options[option_name(name)] = value
        i += 1
    return options


def data_option() -> Any:
    return typer.Option(None, "--data", metavar="PATH_OR_NAME",
                        help="Train the gpt task on this text: a folder, a .txt/.jsonl/.csv/.parquet file or glob, or "
                             "a Hugging Face dataset name (stdlib: Python's own source); stream:PATH_OR_NAME reads "
                             "its shard files a unit at a time instead of tokenizing it whole. Sets --task gpt if no "
                             "task is given.")


def tokenizer_option() -> Any:
    return typer.Option(None, "--tokenizer", metavar="PATH_OR_NAME",
                        help="With --data: bytes (the default), a tokenizer.json (or a folder holding one), or a "
                             "tokenizer transformers loads: a folder it saved or a Hub name such as gpt2.")


def seq_len_option() -> Any:
    return typer.Option(None, "--seq-len", min=1, help="With --data: tokens per training sequence (default 128).")


def with_data(task: str | None, task_options: dict[str, str], data: str | None, tokenizer: str | None,
              seq_len: int | None) -> tuple[str | None, dict[str, str]]:
    """The task and its options once `--data`, `--tokenizer` and `--seq-len` are applied: they are
    options of the task (the gpt task unless another is named), and win over `--task-opt`."""
    given = {"data": data, "tokenizer": tokenizer, "seq_len": None if seq_len is None else str(seq_len)}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return task, task_options
    if data is None:
        raise ValueError("--tokenizer and --seq-len go with --data (or pass them as --task-opt to your task)")
    from starling.data.streaming import PREFIX as STREAM_PREFIX  # here: only a command that trains loads torch

    prefix = STREAM_PREFIX if data.startswith(STREAM_PREFIX) else ""
    local = Path(data[len(prefix):]).expanduser()
    if local.exists():  # the swarm's config names it absolute: a joiner elsewhere never reads a hub name
        given["data"] = prefix + str(local.resolve())
    return task or "gpt", {**task_options, **given}


def prepare_units(task: str | None, task_options: dict[str, str]) -> None:
    """For a task with units (the gpt task), read and tokenize its corpus now: a file that cannot
    be read is one line before anything starts, and the peers find the token file made. (A
    joiner that names no task learns it from the swarm, and reads its data as it starts.)"""
    if task is None:
        return
    from starling.tasks import get_task

    get_task(task, **task_options).data_units()
