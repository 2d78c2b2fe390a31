"""`hf:MODEL`: a `transformers` causal LM from a local folder, on the gpt task's units of a user's
text. A tiny config is built here and saved to a folder: nothing is downloaded."""
from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from starling.data.streaming import IGNORE_INDEX
from starling.node.identity import Identity
from starling.runtime import CheckpointConfig, Trainer, TrainSpec
from starling.tasks import TaskSpecError, get_task
from starling.tasks.hf import HFCausalLMTask

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(vocab_size: int = 257, positions: int = 32) -> transformers.GPT2Config:
    return transformers.GPT2Config(vocab_size=vocab_size, n_positions=positions, n_embd=32, n_layer=1, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                   bos_token_id=None, eos_token_id=None)


@pytest.fixture
def model_folder(tmp_path) -> Path:
    """A folder with a tiny GPT-2's config.json and no weights: the byte tokenizer's 257 ids."""
    folder = tmp_path / "tiny-gpt2"
    tiny_config().save_pretrained(folder)
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for n in range(4):
        (folder / f"doc{n}.txt").write_text(f"document {n}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    return folder


def _options(corpus: Path, tmp_path: Path, **more) -> dict:
    return {"data": str(corpus), "seq_len": 16, "batch_size": 4, "cache_dir": str(tmp_path / "tokens"), **more}


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_folder_with_only_a_config_trains_from_a_seeded_random_start(model_folder, corpus, tmp_path):
    task = get_task(f"hf:{model_folder}", **_options(corpus, tmp_path))
    assert isinstance(task, HFCausalLMTask) and task.name == "hf"
    assert task.config.model == str(model_folder.resolve()) and task.config.tokenizer == "bytes"
    assert task.data_units() > 20
    model = task.make_model()
    assert isinstance(model, transformers.GPT2LMHeadModel) and model.training
    assert model.get_input_embeddings().num_embeddings == 257
    # every peer builds the same weights from the seed, another seed others
    assert _same(_state(model), _state(get_task(f"hf:{model_folder}", **_options(corpus, tmp_path)).make_model()))
    other = get_task(f"hf:{model_folder}", **_options(corpus, tmp_path, seed=1)).make_model()
    assert not torch.equal(other.transformer.wte.weight, model.transformer.wte.weight)

    before = task.evaluate(model)["eval_loss"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in itertools.islice(task.batches(0, 1, 0), 30):
        optimizer.zero_grad()
        task.loss(model, batch).backward()
        optimizer.step()
    after = task.evaluate(model)["eval_loss"]
    assert before > 5.0 and after < 0.75 * before, (before, after)  # log(257) = 5.55 untrained


def test_a_folder_with_weights_starts_from_them_unless_told_otherwise(model_folder, corpus, tmp_path):
    saved = tmp_path / "trained"
    original = transformers.GPT2LMHeadModel(tiny_config())
    original.save_pretrained(saved)
    expected = _state(original)
    assert _same(_state(get_task(f"hf:{saved}", **_options(corpus, tmp_path)).make_model()), expected)
    assert _same(_state(get_task(f"hf:{saved}", **_options(corpus, tmp_path, pretrained="true")).make_model()),
                 expected)
    fresh = get_task(f"hf:{saved}", **_options(corpus, tmp_path, pretrained="false")).make_model()
    assert not torch.equal(fresh.transformer.wte.weight, original.transformer.wte.weight)
    with pytest.raises(ValueError, match="cannot load its weights.*pretrained=false") as info:
        get_task(f"hf:{model_folder}", **_options(corpus, tmp_path, pretrained="true")).make_model()
    assert "\n" not in str(info.value)


def test_bfloat16_parameters_and_a_float32_loss(model_folder, corpus, tmp_path):
    task = get_task(f"hf:{model_folder}", **_options(corpus, tmp_path, dtype="bfloat16"))
    model = task.make_model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    loss = task.loss(model, task.unit_batch(0))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_streamed_unit_with_no_text_has_loss_zero_not_nan(model_folder, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a-empty.jsonl").write_text('{"text": ""}\n' * 20)  # units that hold no document's text
    (shards / "b-text.jsonl").write_text("".join(f'{{"text": "line {n}: the quick brown fox"}}\n' for n in range(40)))
    task = get_task(f"hf:{model_folder}", data=f"stream:{shards}", unit_bytes=64, seq_len=16, batch_size=2,
                    cache_dir=str(tmp_path / "tokens"))
    model = task.make_model()
    empty = task.unit_batch(0)
    assert bool((empty[1] == IGNORE_INDEX).all())
    loss = task.loss(model, empty)
    assert loss.item() == 0.0  # not NaN: nothing to train, and nothing moves
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())

    last = task.data_units() - 1  # text, its last row padded with ignored targets
    inputs, targets = task.unit_batch(last)
    assert bool((targets == IGNORE_INDEX).any()) and bool((targets != IGNORE_INDEX).any())
    logits = model(input_ids=inputs, use_cache=False).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    assert torch.allclose(task.loss(model, (inputs, targets)), expected)


def test_the_model_folders_own_tokenizer_is_the_default(tmp_path, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    words = sorted({w for f in corpus.iterdir() for w in f.read_text().split()})
    vocab = {word: i for i, word in enumerate(["<|endoftext|>", "[UNK]", *words])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "worded"
    tiny_config(vocab_size=len(vocab)).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))

    task = get_task(f"hf:{folder}", **_options(corpus, tmp_path, seq_len=8, batch_size=2))
    assert task.config.tokenizer == str((folder / "tokenizer.json").resolve())
    assert task.tokenizer.vocab_size == len(vocab) and task.data_units() > 0
    assert task.make_model().get_input_embeddings().num_embeddings == len(vocab)
    # the byte tokenizer's 257 ids do not fit this model's embedding
    with pytest.raises(ValueError, match=f"257 ids but model .* embeds {len(vocab)}") as info:
        get_task(f"hf:{folder}", **_options(corpus, tmp_path, tokenizer="bytes")).data_units()
    assert "\n" not in str(info.value)


def _trainer(node, spec: TrainSpec, checkpoint: CheckpointConfig | None) -> Trainer:
    trainer = Trainer(node, spec, rank=0, world=1, serve_state=False, checkpoint=checkpoint)
    trainer.create_protocol()
    return trainer


def _run(trainer: Trainer, steps: int) -> None:
    batches = trainer.batches()
    while trainer.proto.step_count < steps:
        trainer.step(next(batches))


def test_a_resumed_trainer_continues_bit_for_bit(make_node, model_folder, corpus, tmp_path):
    spec = TrainSpec(protocol="diloco", task=f"hf:{model_folder}", options={"sync_every": 3, "lr": 3e-3},
                     task_options=_options(corpus, tmp_path), seed=3)
    key = Identity.generate()  # a restarted peer is the same peer (its key is on its disk): the same units
    whole = _trainer(make_node("inproc", key=key), spec, None)
    _run(whole, 8)
    expected = _state(whole.proto.eval_model())
    whole.close()

    config = CheckpointConfig(str(tmp_path / "ckpt"), every=5, keep=2)
    first = _trainer(make_node("inproc", key=key), spec, config)
    _run(first, 7)  # a checkpoint at step 5; steps 6 and 7 are lost with the "crash"
    first.close()
    second = _trainer(make_node("inproc", key=key), spec, config)
    checkpoint = second.resume()
    assert checkpoint is not None and checkpoint.step == 5 and second.proto.step_count == 5
    _run(second, 8)
    assert _same(_state(second.proto.eval_model()), expected)
    second.close()


@pytest.mark.parametrize(("spec", "options", "match"), [
    ("hf:", {}, "hf: needs a model"),
    ("hf:{folder}", {"dtype": "float64"}, "unknown dtype 'float64'; choose float32, bfloat16 or float16"),
    ("hf:{folder}", {"pretrained": "maybe"}, "pretrained must be one of auto, true, false"),
    ("hf:{folder}", {"model": "gpt2"}, "the model is the NAME of hf:NAME"),
    ("hf:{folder}", {"n_layer": "2"}, "unknown option 'n_layer'"),
    ("hf:{folder}", {"seq_len": "0"}, "seq_len must be >= 1"),
])
def test_bad_options_are_refused_in_one_line(model_folder, spec, options, match):
    with pytest.raises(TaskSpecError, match=match) as info:
        get_task(spec.format(folder=model_folder), **options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("model", "options", "match"), [
    ("{folder}", {"seq_len": "64"}, "seq_len 64 is past the 32 positions of model"),
    ("{folder}/missing", {}, "missing': no such folder"),
    ("{folder}/..", {}, "transformers cannot load its config"),  # a folder without a config.json
])
def test_what_the_model_cannot_take_is_refused_in_one_line(model_folder, corpus, tmp_path, model, options, match):
    task = get_task(f"hf:{model.format(folder=model_folder)}", **{**_options(corpus, tmp_path), **options})
    with pytest.raises(ValueError, match=match) as info:
        task.data_units()
    assert "\n" not in str(info.value)


def test_without_transformers_the_task_is_refused_in_one_line(model_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(TaskSpecError, match=r"needs Hugging Face `transformers`: .*pip install 'starling\[hf\]'"):
        get_task(f"hf:{model_folder}")
