"""Tokenizers: the byte-level one and a trained `tokenizer.json`."""
from __future__ import annotations

from pathlib import Path

import pytest

from starling.data.sources import DataError
from starling.data.tokenizer import ByteTokenizer, FileTokenizer, load_tokenizer

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
