"""The gpt task on a user's text: units of a tokenized corpus, a model sized to the tokenizer,
an evaluation on held-out units, and clear errors for a corpus too small to cut."""
from __future__ import annotations

import pytest
import torch

from starling.tasks import get_task


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("héllo wörld, " * 200)
    (folder / "b.txt").write_text("the end. " * 100)
    return folder


def _task(corpus, tmp_path, **options):
    return get_task("gpt", data=str(corpus), seq_len=16, batch_size=4, n_embd=16, n_layer=1,
                    cache_dir=str(tmp_path / "tokens"), **options)


def test_units_are_batches_of_rows_and_the_model_fits_the_tokenizer(corpus, tmp_path):
    task = _task(corpus, tmp_path)
    units = task.data_units()
    rows = task.store.rows(16)
    held_out = max(1, int(rows // 4 * 0.02))
    assert units == rows // 4 - held_out
    x, y = task.unit_batch(units - 1)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one token
    model = task.make_model()
    assert model.tok_emb.num_embeddings == 257  # bytes and the end-of-text id
    loss = task.loss(model, (x, y))
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 1.0
    assert set(task.evaluate(model)) == {"eval_loss"}
    with pytest.raises(IndexError, match=f"one of the {units} training units"):
        task.unit_batch(units)  # the held-out units are not handed out


def test_without_a_swarm_each_rank_reads_every_worldth_unit_of_the_epochs_order(corpus, tmp_path):
    task = _task(corpus, tmp_path)
    first = [next(it) for it in [task.batches(0, 2, 1)] for _ in range(3)]
    second = [next(it) for it in [task.batches(1, 2, 1)] for _ in range(3)]
    assert not any(torch.equal(a[0], b[0]) for a in first for b in second)


def test_a_corpus_too_small_to_hold_one_unit_out_is_refused_with_what_to_change(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "a.txt").write_text("too short")
    with pytest.raises(ValueError, match="too few.*smaller seq_len or batch_size"):
        _task(folder, tmp_path).data_units()


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="seq_len"):
        get_task("gpt", seq_len=0)
    with pytest.raises(ValueError, match="eval_fraction"):
        get_task("gpt", eval_fraction=1.5)


def test_a_stream_corpus_is_read_a_unit_at_a_time_and_never_tokenized_whole(tmp_path):
    import json
    import math

    folder = tmp_path / "shards"
    folder.mkdir()
    for s in range(3):
        lines = [json.dumps({"text": f"document {s}.{i}: " + "héllo wörld " * (i % 7)}) for i in range(40)]
        (folder / f"part-{s}.jsonl").write_text("\n".join(lines) + "\n")
    task = get_task("gpt", data=f"stream:{folder}", seq_len=16, batch_size=4, n_embd=16, n_layer=1,
                    cache_dir=str(tmp_path / "tokens"))
    units = task.data_units()
    stream = task.stream
    assert stream.unit_bytes == 4 * 16  # the byte tokenizer: a byte a token, batch_size rows
    assert units == stream.units - max(1, math.floor(stream.units * 0.02))
    x, y = task.unit_batch(units - 1)
    assert x.shape == y.shape and x.shape[1] == 16 and x.dtype == torch.int64
    model = task.make_model()
    loss = task.loss(model, (x, y))
    assert loss.shape == () and torch.isfinite(loss) and set(task.evaluate(model)) == {"eval_loss"}
    assert next(task.batches(0, 2, 0))[0].shape[1] == 16
    assert not (tmp_path / "tokens").exists()  # no token file
    # a unit that holds no text to train on adds nothing, rather than a NaN
    nothing = task.loss(model, (x, torch.full_like(y, -100)))
    nothing.backward()
    assert nothing.item() == 0.0 and all(p.grad is None or not p.grad.any() for p in model.parameters())
    with pytest.raises(IndexError, match=f"one of the {units} training units"):
        task.unit_batch(units)
    with pytest.raises(ValueError, match="a stream: corpus is read a unit at a time"):
        get_task("gpt", data=f"stream:{folder}", partition="iid")
    with pytest.raises(ValueError, match="unit_bytes must be >= 0"):
        get_task("gpt", data=f"stream:{folder}", unit_bytes=-1)
