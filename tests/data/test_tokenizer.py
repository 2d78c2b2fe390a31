"""Tokenizers: the byte-level one, a trained `tokenizer.json`, and one `transformers` loads."""
from __future__ import annotations

import json
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from starling.data.sources import DataError
from starling.data.tokenizer import ByteTokenizer, FileTokenizer, HFTokenizer, load_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "a tokenizer for tests", "the end"] * 20


def train_bpe(folder: Path, *, special_tokens: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_byte_tokenizer_round_trips_any_text() -> None:
    tokenizer = load_tokenizer("bytes")
    assert isinstance(tokenizer, ByteTokenizer) and isinstance(load_tokenizer(""), ByteTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.name) == (257, 256, "bytes")
    texts = ["hello", "", "héllo wörld ✓ 日本語 🙂"]
    encoded = tokenizer.encode_batch(texts)
    assert encoded[0] == list(b"hello") and encoded[1] == []
    assert encoded[2] == list(texts[2].encode("utf-8"))
    assert all(type(token_id) is int for token_id in encoded[2])
    assert [tokenizer.decode(ids) for ids in encoded] == texts
    assert tokenizer.decode(encoded[0] + [tokenizer.eos_id]) == "hello"
    assert tokenizer.fingerprint() == ByteTokenizer().fingerprint()


def test_trained_bpe_with_its_end_of_text_token(tmp_path: Path) -> None:
    path = train_bpe(tmp_path, special_tokens=["<|endoftext|>"])
    tokenizer = load_tokenizer(str(path))
    assert isinstance(tokenizer, FileTokenizer)
    assert tokenizer.eos_id == 0  # the first special token the trainer adds
    assert tokenizer.vocab_size == 300
    [ids] = tokenizer.encode_batch(["the quick brown fox"])
    assert ids and all(0 <= token_id < tokenizer.vocab_size for token_id in ids)
    assert tokenizer.eos_id not in ids
    assert tokenizer.decode(ids) == "the quick brown fox"
    # A folder holding tokenizer.json names the same tokenizer.
    same = load_tokenizer(str(tmp_path))
    assert same.fingerprint() == tokenizer.fingerprint() and same.eos_id == tokenizer.eos_id


def test_a_vocabulary_without_an_end_token_gets_one_past_it(tmp_path: Path) -> None:
    path = train_bpe(tmp_path, special_tokens=[])
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.eos_id == 300 and tokenizer.vocab_size == 301
    [ids] = tokenizer.encode_batch(["the end"])
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == "the end"


def test_second_candidate_is_used_when_the_first_is_absent(tmp_path: Path) -> None:
    path = train_bpe(tmp_path, special_tokens=["<pad>", "</s>"])
    assert load_tokenizer(str(path)).eos_id == 1


def test_unreadable_tokenizers_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(DataError, match=str(missing)):
        load_tokenizer(str(missing))
    with pytest.raises(DataError, match=f"{tmp_path}: a folder without a tokenizer.json"):
        load_tokenizer(str(tmp_path))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("this is not json")
    with pytest.raises(DataError) as caught:
        load_tokenizer(str(garbage))
    assert str(garbage) in str(caught.value) and "expected" in str(caught.value)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match=str(binary)):
        load_tokenizer(str(binary))


def test_tokenizers_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    path = train_bpe(tmp_path, special_tokens=["<|endoftext|>"])
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match=r"pip install 'starling\[data\]'"):
        load_tokenizer(str(path))


def save_transformers_tokenizer(folder: Path, *, special_tokens: list[str], eos_token: str | None) -> Path:
    """A tiny BPE tokenizer saved as `transformers` saves one (`save_pretrained`) into `folder`."""
    transformers = pytest.importorskip("transformers")
    work = folder.parent / f".{folder.name}-trained"
    work.mkdir(parents=True)
    trained = train_bpe(work, special_tokens=special_tokens)
    options = {} if eos_token is None else {"eos_token": eos_token}
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(trained), **options).save_pretrained(str(folder))
    return folder


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: socket.socket, address: Any) -> None:
        raise AssertionError(f"a connection to {address} during a test that must stay offline")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_a_folder_transformers_saved_loads_offline(tmp_path: Path, no_network: None) -> None:
    folder = save_transformers_tokenizer(tmp_path / "tok", special_tokens=["<pad>", "<|endoftext|>"],
                                         eos_token="<|endoftext|>")
    assert (folder / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(str(folder))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.name == str(folder)
    assert tokenizer.eos_id == 1 and tokenizer.vocab_size == 300  # its own eos_token, not a guess
    [ids, empty] = tokenizer.encode_batch(["the quick brown fox", ""])
    assert ids and empty == [] and all(0 <= i < tokenizer.vocab_size for i in ids) and tokenizer.eos_id not in ids
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == "the quick brown fox<|endoftext|>"
    # the same ids as the tokenizer.json it was built from
    assert ids == load_tokenizer(str(folder / "tokenizer.json")).encode_batch(["the quick brown fox"])[0]


def test_without_an_eos_token_one_is_found_or_added(tmp_path: Path, no_network: None) -> None:
    found = load_tokenizer(str(save_transformers_tokenizer(tmp_path / "a", special_tokens=["<pad>", "</s>"],
                                                           eos_token=None)))
    assert found.eos_id == 1 and found.vocab_size == 300
    added = load_tokenizer(str(save_transformers_tokenizer(tmp_path / "b", special_tokens=[], eos_token=None)))
    assert added.eos_id == 300 and added.vocab_size == 301
    [ids] = added.encode_batch(["the end"])
    assert added.decode(ids + [added.eos_id]) == "the end"


def test_the_fingerprint_is_the_content_not_the_path_or_name(tmp_path: Path, no_network: None) -> None:
    original = save_transformers_tokenizer(tmp_path / "one" / "tok", special_tokens=["<|endoftext|>"],
                                           eos_token="<|endoftext|>")
    copy = tmp_path / "two" / "elsewhere"
    shutil.copytree(original, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps(config, indent=7, sort_keys=True))  # same content
    first = load_tokenizer(str(original)).fingerprint()
    assert len(first) == 64 and load_tokenizer(str(copy)).fingerprint() == first

    # Same name, other files: two tokens of the vocabulary swap their ids.
    changed = tmp_path / "three" / "tok"
    shutil.copytree(original, changed)
    pipeline = json.loads((changed / "tokenizer.json").read_text())
    vocab = pipeline["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (changed / "tokenizer.json").write_text(json.dumps(pipeline))
    assert load_tokenizer(str(changed)).fingerprint() != first

    # Same name, other end-of-document token.
    other_eos = save_transformers_tokenizer(tmp_path / "four" / "tok", special_tokens=["<|endoftext|>", "</s>"],
                                            eos_token="</s>")
    assert load_tokenizer(str(other_eos)).fingerprint() not in (first, load_tokenizer(str(changed)).fingerprint())


def test_a_name_that_is_not_a_path_goes_to_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       no_network: None) -> None:
    import transformers

    folder = save_transformers_tokenizer(tmp_path / "tok", special_tokens=["<|endoftext|>"], eos_token="<|endoftext|>")
    real = transformers.AutoTokenizer.from_pretrained
    asked: list[tuple[str, bool]] = []

    def from_cache(name: str, **options: Any) -> Any:  # the hub's cache, standing in for the hub
        asked.append((name, options["local_files_only"]))
        if name != "owner/tiny":
            raise OSError(f"{name} is not a local folder and is not a valid model identifier")
        return real(str(folder), **options)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_cache)
    by_name = load_tokenizer("owner/tiny")
    assert isinstance(by_name, HFTokenizer) and by_name.name == "owner/tiny" and asked == [("owner/tiny", False)]
    with pytest.raises(DataError) as caught:
        load_tokenizer("gpt-nothing")
    assert str(caught.value) == ("tokenizer gpt-nothing: transformers cannot load it: OSError: gpt-nothing is not "
                                 "a local folder and is not a valid model identifier")
    # a path that does not exist is never taken for a name
    with pytest.raises(DataError, match="no such tokenizer file"):
        load_tokenizer(str(tmp_path / "missing" / "tok"))
    assert [name for name, _ in asked] == ["owner/tiny", "gpt-nothing"]


def test_transformers_missing_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_transformers_tokenizer(tmp_path / "tok", special_tokens=["<|endoftext|>"], eos_token="<|endoftext|>")
    monkeypatch.setitem(sys.modules, "transformers", None)
    for spec in (str(folder), "gpt2"):
        with pytest.raises(DataError) as caught:
            load_tokenizer(spec)
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"tokenizer {spec}: ")
        assert "pip install 'starling[hf]'" in message
    assert isinstance(load_tokenizer(str(folder / "tokenizer.json")), FileTokenizer)  # a file needs no transformers
