"""`--data`, `--tokenizer` and `--seq-len`: the gpt task on a user's text from the command line,
and one clear line for what cannot be read."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from starling.cli.main import app

runner = CliRunner()


def _args(text_corpus, tmp_path, *more: str) -> list[str]:
    return ["simulate", "--data", str(text_corpus), "--seq-len", "16", "--peers", "2", "--steps", "3",
            "--protocol", "allreduce", "--baseline", "none", "--json",
            "--task-opt", "batch_size=2", "--task-opt", "n_embd=16", "--task-opt", "n_layer=1",
            "--task-opt", f"cache_dir={tmp_path / 'tokens'}", *more]


def test_simulate_trains_the_gpt_task_on_a_folder_of_text(text_corpus, tmp_path):
    result = runner.invoke(app, _args(text_corpus, tmp_path))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["task"] == "gpt" and summary["eval_loss"] > 0
    assert list((tmp_path / "tokens").glob("*.json"))  # the token file, made once for every peer


def _one_line(result) -> str:
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error:"), result.output
    return lines[0]


def test_what_cannot_be_read_is_one_line_naming_it(text_corpus, tmp_path):
    assert "no such file or folder" in _one_line(runner.invoke(app, _args(tmp_path / "nowhere", tmp_path)))
    (text_corpus / "broken.txt").write_bytes(b"fine, then \xff\xfe not utf-8")
    assert "broken.txt" in _one_line(runner.invoke(app, _args(text_corpus, tmp_path)))
    (text_corpus / "broken.txt").unlink()
    line = _one_line(runner.invoke(app, _args(text_corpus, tmp_path, "--tokenizer", str(tmp_path / "tok.json"))))
    assert "tok.json" in line
    line = _one_line(runner.invoke(app, ["simulate", "--seq-len", "16", "--baseline", "none"]))
    assert "--data" in line


def test_simulate_trains_a_hugging_face_model_from_a_local_folder(text_corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tiny-gpt2"  # a config only: nothing downloaded, weights from the seed
    transformers.GPT2Config(vocab_size=257, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                            ).save_pretrained(folder)
    args = ["simulate", "--task", f"hf:{folder}", "--data", str(text_corpus), "--peers", "2", "--steps", "3",
            "--protocol", "allreduce", "--baseline", "none", "--json",
            "--task-opt", "batch_size=2", "--task-opt", f"cache_dir={tmp_path / 'tokens'}"]
    result = runner.invoke(app, [*args, "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["task"] == f"hf:{folder}" and summary["final_peers"] == 2
    assert 0 < summary["eval_loss"] < 6.0  # about log(257) = 5.55 after 3 steps
    assert "32 positions" in _one_line(runner.invoke(app, [*args, "--seq-len", "64"]))
