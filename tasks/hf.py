"""`hf:MODEL`: a Hugging Face causal language model trained on a user's text.

MODEL is a local folder that `transformers` can load (its `config.json`, and its weights when
it has them), or a model's name on the Hugging Face hub. The data are the `gpt` task's
(`tasks/textlm.py`): `data` is tokenized once into a token file and cut into units of
`batch_size` rows of `seq_len + 1` tokens, which a swarm hands out (or `partition` cuts); the
last `eval_fraction` of them is held out, and `evaluate` reads the first `eval_batches` of those.
A ``stream:`` corpus is read a unit at a time instead; the loss leaves out the padded targets of
a unit's last row, and a unit with no text adds a loss of 0, not NaN (`token_loss`).

`pretrained` says where the initial weights come from:

- ``auto`` (the default): a local folder's weights when it holds some (``*.safetensors`` or
  ``pytorch_model*.bin``), else a random initialisation from its config; a hub name's weights;
- ``true``: the weights, and a folder without any is refused;
- ``false``: the config only. The model is initialised as `transformers` initialises it, from
  torch's RNG seeded by `seed` for that one call (under a lock, so that peers built in one
  process get the same weights; a tensor the weights lack is drawn the same way).

A local folder is read with ``local_files_only``: it never touches the network. A hub name goes
through the Hugging Face cache (downloaded on first use, `revision` pins it; ``HF_HUB_OFFLINE=1``
forbids the download). Models whose code is not part of `transformers` (``trust_remote_code``)
are not loaded.

`dtype` (float32, bfloat16 or float16) is the model's parameter dtype as the task builds it, on
every peer; the runtime's own `--dtype` may lower one peer's copy further. `tokenizer` is the
`gpt` task's (bytes, or a `tokenizer.json`); left empty, it is the model folder's own
`tokenizer.json` when it has one, else bytes. A tokenizer whose ids the model cannot embed (more
ids than its input embedding has rows) is refused, as is a `seq_len` past the model's positions.

`transformers` is optional (``pip install 'starling[hf]'``); without it, `hf:` is refused in
one line. It is imported when the model's config is first read, not when the task is built.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from starling.common import derive_seed
from starling.common.devices import resolve_dtype, to_model_device
from starling.common.options import parse_bool

from .textlm import Batch, TextDataConfig, TextLMTask, token_loss

PREFIX = "hf:"
INSTALL_HINT = "install it with `pip install 'starling[hf]'`"
PRETRAINED_CHOICES = ("auto", "true", "false")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")  # the files transformers loads weights from

# transformers initialises a model from torch's global RNG: one build at a time, so that a
# seeded build is not interleaved with another's draws.
_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True)
class HFCausalLMConfig(TextDataConfig):
    model: str = ""  # a local folder or a hub model name (the NAME of `hf:NAME`)
    pretrained: str = "auto"  # auto, true or false: where the initial weights come from (see the module)
    dtype: str = "float32"  # float32, bfloat16 or float16: the parameters as the task builds them
    revision: str = ""  # a hub name's branch, tag or commit; "" = its default branch
    seed: int = 0  # a random initialisation's weights
    tokenizer: str = ""  # "" = the model folder's tokenizer.json if it has one, else bytes

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model.strip():
            raise ValueError("model must name a folder or a hub model (hf:NAME)")
        if self.pretrained.strip().lower() != "auto":
            try:
                parse_bool(self.pretrained)
            except ValueError:
                raise ValueError(f"pretrained must be one of {', '.join(PRETRAINED_CHOICES)}, "
                                 f"got {self.pretrained!r}") from None
        resolve_dtype(self.dtype)  # a DeviceError (ValueError) naming the choices

    @property
    def folder(self) -> Path | None:
        """The model's local folder, or None for a hub name."""
        path = Path(self.model).expanduser()
        return path if path.is_dir() else None

    @property
    def loads_weights(self) -> bool:
        """Whether the initial weights are the model's own rather than a random initialisation."""
        choice = self.pretrained.strip().lower()
        if choice != "auto":
            return parse_bool(choice)
        folder = self.folder
        return folder is None or any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS)


def transformers_installed() -> bool:
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


class HFCausalLMTask(TextLMTask):
    """A `transformers` causal LM on the units of a tokenized corpus (see the module)."""

    name = "hf"
    config_class = HFCausalLMConfig
    config: HFCausalLMConfig

    def __init__(self, config: HFCausalLMConfig) -> None:
        if not transformers_installed():
            raise ValueError(f"task hf:{config.model} needs Hugging Face `transformers`: {INSTALL_HINT}")
        folder = config.folder
        if folder is not None:  # one name for the folder whatever the working directory
            config = dataclasses.replace(config, model=str(folder.resolve()))
        if not config.tokenizer:
            own = folder / "tokenizer.json" if folder is not None else None
            config = dataclasses.replace(config, tokenizer=str(own.resolve()) if own and own.is_file() else "bytes")
        super().__init__(config)  # type: ignore[arg-type]
        self.config = config

    @classmethod
    def for_spec(cls, spec: str, **options: Any) -> HFCausalLMTask:
        """The task of ``"hf:NAME"``; `options` must not name the model again."""
        model = spec.removeprefix(PREFIX).strip()
        if "model" in options:
            raise ValueError(f"the model is the NAME of hf:NAME, not an option (got model={options['model']!r})")
        if not model:
            raise ValueError("hf: needs a model: hf:NAME, a folder transformers can load or a hub model name")
        return cls.from_options(model=model, **options)  # type: ignore[return-value]

    # ------------------------------------------------------------------ the model's config
    def _load_kwargs(self) -> dict[str, Any]:
        c = self.config
        if c.folder is not None:
            return {"local_files_only": True}
        return {"revision": c.revision} if c.revision else {}

    @functools.cached_property
    def hf_config(self) -> Any:
        """The model's `transformers` config, read once; ValueError in one line if it cannot be."""
        model = self.config.model
        if self.config.folder is None and _names_a_path(model):
            raise ValueError(f"model {model!r}: no such folder (a hub model's name is NAME or ORG/NAME)")
        transformers = _import_transformers(model)
        try:
            return transformers.AutoConfig.from_pretrained(self.config.model, **self._load_kwargs())
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"model {self.config.model!r}: transformers cannot load its config: "
                             f"{_first_line(e)}") from None

    def check_fits(self, embedding_rows: int | None = None) -> None:
        """ValueError in one line if the tokenizer's ids outgrow the model's input embedding
        (`embedding_rows`, else its config's vocab_size) or `seq_len` its positions."""
        text = self.hf_config.get_text_config()
        rows = embedding_rows if embedding_rows is not None else getattr(text, "vocab_size", None)
        ids = self.tokenizer.vocab_size
        if rows is not None and ids > rows:
            raise ValueError(f"tokenizer {self.config.tokenizer!r} has {ids} ids but model {self.config.model!r} "
                             f"embeds {rows}: use the model's own tokenizer, or a model with vocab_size >= {ids}")
        positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        if isinstance(positions, int) and self.config.seq_len > positions:
            raise ValueError(f"seq_len {self.config.seq_len} is past the {positions} positions of model "
                             f"{self.config.model!r}")

    # ------------------------------------------------------------------ data: the gpt task's, checked
    def data_units(self) -> int | None:
        self.check_fits()
        return super().data_units()

    # ------------------------------------------------------------------ model
    def make_model(self) -> nn.Module:
        c = self.config
        transformers = _import_transformers(c.model)
        config = self.hf_config
        dtype = resolve_dtype(c.dtype)
        try:
            # seeded: a random initialisation, and the tensors a checkpoint lacks, are drawn from it
            with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed("hf-init", c.seed))
                if c.loads_weights:
                    model = transformers.AutoModelForCausalLM.from_pretrained(c.model, dtype=dtype,
                                                                              **self._load_kwargs())
                else:
                    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        except (OSError, ValueError, KeyError) as e:
            what = "load its weights (pretrained=false starts from its config)" if c.loads_weights \
                else "build it from its config"
            raise ValueError(f"model {c.model!r}: transformers cannot {what}: {_first_line(e)}") from None
        self.check_fits(model.get_input_embeddings().num_embeddings)
        return model.train()

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = (to_model_device(t, model) for t in batch)
        logits = model(input_ids=x, use_cache=False).logits
        return token_loss(logits, y)  # a streamed unit with no text (every target ignored): 0, not NaN


def _import_transformers(model: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"task hf:{model} needs Hugging Face `transformers`: {INSTALL_HINT}") from None
    transformers.utils.logging.disable_progress_bar()  # a bar per load drowns the trainer's own log
    return transformers


def _names_a_path(model: str) -> bool:
    """Whether `model` can only be a path (a hub name is NAME or ORG/NAME)."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or (os.sep != "/" and os.sep in model)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
