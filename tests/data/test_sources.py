"""Sources: folders of text files, tables read by `datasets`, and the dispatch from a spec."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from starling.data.sources import DataError, HFSource, TextFolderSource, open_source, stdlib_source


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    write(root / "b.txt", "bee")
    write(root / "a.md", "ay")
    write(root / "sub" / "c.py", "see")
    write(root / "sub" / "deeper" / "d.rst", "dee")
    write(root / "image.png", b"\x89PNG")
    write(root / "A.txt", "capital")
    return root


def test_text_folder_reads_every_text_file_sorted_by_relative_path(folder: Path) -> None:
    source = TextFolderSource(folder)
    assert list(source.documents()) == ["capital", "ay", "bee", "see", "dee"]
    assert source.name == str(folder)


def test_text_folder_filters_by_suffix_and_can_stay_flat(folder: Path) -> None:
    assert list(TextFolderSource(folder, suffixes=(".py",)).documents()) == ["see"]
    assert list(TextFolderSource(folder, recursive=False).documents()) == ["capital", "ay", "bee"]
    # `suffixes=()` takes every file, the image too.
    with pytest.raises(DataError, match="image.png.*not UTF-8.*byte offset 0"):
        list(TextFolderSource(folder, suffixes=()).documents())


def test_text_folder_names_the_file_and_offset_of_bad_utf8(tmp_path: Path) -> None:
    write(tmp_path / "good.txt", "fine")
    bad = write(tmp_path / "bad.txt", "héllo".encode()[:2] + b"\xff rest")
    documents = TextFolderSource(tmp_path).documents()
    with pytest.raises(DataError) as caught:
        list(documents)
    assert str(bad) in str(caught.value)
    assert "byte offset 1" in str(caught.value)


def test_text_folder_without_matching_files_is_an_error(tmp_path: Path) -> None:
    write(tmp_path / "data.bin", b"\x00")
    with pytest.raises(DataError) as caught:
        TextFolderSource(tmp_path, suffixes=(".txt", ".md"))
    assert str(tmp_path) in str(caught.value) and ".txt .md" in str(caught.value)
    with pytest.raises(DataError, match="not a folder"):
        TextFolderSource(tmp_path / "missing")


def test_text_folder_fingerprint_follows_the_content(folder: Path) -> None:
    first = TextFolderSource(folder).fingerprint()
    assert TextFolderSource(folder).fingerprint() == first
    file = folder / "b.txt"
    file.write_text("bee, changed")
    assert TextFolderSource(folder).fingerprint() != first
    changed = TextFolderSource(folder).fingerprint()
    write(folder / "sub" / "new.txt", "new")
    assert TextFolderSource(folder).fingerprint() != changed


def test_stdlib_source_is_the_top_level_python_files() -> None:
    source = stdlib_source()
    assert source.name == "stdlib" and not source.recursive
    first = next(iter(source.documents()))
    assert isinstance(first, str) and first


# Hugging Face `datasets` tables.


def test_jsonl_rows_are_documents_and_none_is_empty(tmp_path: Path) -> None:
    rows = [{"text": "one", "id": 1}, {"text": None, "id": 2}, {"text": "thr\u00e9e", "id": 3}]
    file = write(tmp_path / "rows.jsonl", "\n".join(json.dumps(row) for row in rows) + "\n")
    source = HFSource(str(file), cache_dir=tmp_path / "cache")
    assert list(source.documents()) == ["one", "", "thr\u00e9e"]
    assert len(source) == 3 and len(source.fingerprint()) == 64


def test_csv_with_another_text_column(tmp_path: Path) -> None:
    file = write(tmp_path / "rows.csv", 'label,body\n1,"hello, world"\n2,second\n')
    source = HFSource(str(file), text_field="body", cache_dir=tmp_path / "cache")
    assert list(source.documents()) == ["hello, world", "second"]


def test_parquet_folder_in_file_order(tmp_path: Path) -> None:
    folder = tmp_path / "tables"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["b1", "b2"]}), folder / "b.parquet")
    pq.write_table(pa.table({"text": ["a1"]}), folder / "a.parquet")
    source = open_source(str(folder), cache_dir=tmp_path / "cache")
    assert isinstance(source, HFSource)
    assert list(source.documents()) == ["a1", "b1", "b2"]


def test_txt_file_is_one_document(tmp_path: Path) -> None:
    file = write(tmp_path / "book.txt", "line one\nline two\n")
    source = open_source(str(file), cache_dir=tmp_path / "cache")
    assert isinstance(source, HFSource)
    assert list(source.documents()) == ["line one\nline two\n"]


def test_glob_reads_the_matching_files(tmp_path: Path) -> None:
    write(tmp_path / "d" / "1.jsonl", '{"text": "x"}\n')
    write(tmp_path / "d" / "2.jsonl", '{"text": "y"}\n')
    write(tmp_path / "d" / "notes.md", "ignored")
    source = open_source(str(tmp_path / "d" / "*.jsonl"), cache_dir=tmp_path / "cache")
    assert list(source.documents()) == ["x", "y"]


def test_missing_column_lists_the_columns(tmp_path: Path) -> None:
    file = write(tmp_path / "rows.jsonl", '{"body": "x", "id": 1}\n')
    with pytest.raises(DataError) as caught:
        HFSource(str(file), cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert str(file) in message and "'text'" in message and "body" in message and "id" in message


def test_a_non_text_column_is_an_error(tmp_path: Path) -> None:
    file = write(tmp_path / "rows.csv", "text,id\n1,2\n")
    with pytest.raises(DataError, match="not text"):
        HFSource(str(file), cache_dir=tmp_path / "cache")


def test_malformed_jsonl_names_the_file_on_one_line(tmp_path: Path) -> None:
    file = write(tmp_path / "broken.jsonl", '{"text": "fine"}\n{"text": \n')
    with pytest.raises(DataError) as caught:
        HFSource(str(file), cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert str(file) in message and "\n" not in message
    assert "JSON" in message


def test_broken_parquet_names_the_file(tmp_path: Path) -> None:
    file = write(tmp_path / "broken.parquet", b"not a parquet file")
    with pytest.raises(DataError, match=str(file)):
        HFSource(str(file), cache_dir=tmp_path / "cache")


# open_source dispatch.


def test_open_source_dispatch(tmp_path: Path, folder: Path) -> None:
    assert open_source("").name == "stdlib"
    assert open_source("stdlib").name == "stdlib"
    text_folder = open_source(str(folder))
    assert isinstance(text_folder, TextFolderSource) and text_folder.name == str(folder)
    # A folder mixing tables with text is a text corpus.
    mixed = tmp_path / "mixed"
    write(mixed / "rows.jsonl", '{"text": "x"}\n')
    write(mixed / "readme.md", "# hi")
    assert isinstance(open_source(str(mixed)), TextFolderSource)


def test_open_source_rejects_what_it_cannot_read(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "file.jsonl"
    with pytest.raises(DataError, match=f"no such file or folder: {missing}"):
        open_source(str(missing))
    for spec in ("./missing", "~/surely-not-here-starling", "data/rows.jsonl"):
        with pytest.raises(DataError, match="no such file or folder"):
            open_source(spec)
    unknown = write(tmp_path / "weights.bin", b"\x00")
    with pytest.raises(DataError) as caught:
        open_source(str(unknown))
    assert str(unknown) in str(caught.value) and ".jsonl" in str(caught.value) and ".parquet" in str(caught.value)
    with pytest.raises(DataError, match="no data files match"):
        open_source(str(tmp_path / "*.csv"))


def test_datasets_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    file = write(tmp_path / "rows.jsonl", '{"text": "x"}\n')
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"pip install 'starling\[data\]'"):
        HFSource(str(file))


def test_relative_folder_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "texts" / "a.txt", "hello")
    monkeypatch.chdir(tmp_path)
    source = open_source("texts")
    assert isinstance(source, TextFolderSource)
    assert list(source.documents()) == ["hello"]
    assert os.path.basename(source.name) == "texts"
