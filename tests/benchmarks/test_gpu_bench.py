"""benchmarks/gpu.py on the CPU with --quick: the code a GPU run takes prints every section's
rows without an error or a failed check, and a failure in one place is a row, not the end of
the run."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import load_benchmark


def load_bench():
    return load_benchmark("gpu")


def rows_of(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.mark.slow
def test_a_quick_cpu_run_prints_every_section_without_errors(capsys):
    bench = load_bench()
    code = bench.main(["--device", "cpu", "--quick"])
    rows = rows_of(capsys)
    failed = [r for r in rows if "error" in r or r.get("ok") is False]
    assert not failed, failed
    assert code == 0 and rows[-1]["summary"] and rows[-1]["failed"] == []
    assert {r["section"] for r in rows if "section" in r} == set(bench.SECTIONS)

    codecs = [r for r in rows if r.get("section") == "codecs" and "codec" in r]
    assert {(r["codec"], r["dtype"]) for r in codecs} == {(spec, dtype) for spec, *_ in bench.CODECS
                                                           for dtype in ("float32", "bfloat16")}
    assert all(r["encode_over_copy"] > 0 and r["decode_over_copy"] > 0 and r["ok"] for r in codecs)
    assert not any(r["fused_kernel"] for r in codecs)  # the CPU keeps its eager loops
    assert next(r for r in rows if "missing_from_bench" in r)["missing_from_bench"] == []
    lossless = [r for r in codecs if r["lossless"]]
    assert lossless and all(r["rel_l2"] == 0.0 and r["decoded_equal_cpu"] for r in lossless)

    sims = [r for r in rows if r.get("section") == "simulate" and "run" in r]
    assert len(sims) == len(bench.PRECISIONS) * 3
    for row in sims:
        assert row["eval_finite"] and row["peer_status"] == ["finished"] and row["steps_done"] == row["steps"]
        assert row["peers_agree"] or not row["one_model_promised"]
        assert (row["run"] == "no-sync") == ("step_over_no_sync" not in row)
    assert all(r["rounds"] > 0 for r in sims if r["run"] == "streaming-diloco")
    assert all(r["rounds"] == 0 and r["bytes_sent_per_peer"] == 0 for r in sims if r["run"] == "no-sync")

    state = next(r for r in rows if r.get("section") == "state_device" and "run" in r)
    assert state["matches"] and state["bit_identical"]  # on the CPU the same arithmetic, step for step
    staging = next(r for r in rows if r.get("section") == "staging" and "codec" in r)
    assert not staging["staged"] and staging["pinned_mb"] == 0  # nothing to pin beside no accelerator

    gpt = [r for r in rows if r.get("section") == "gpt"]
    assert gpt[0]["vocab"] == 300 and gpt[0]["parameters"] > 0 and gpt[0]["tokens"] > 0
    assert {r["run"] for r in gpt if "run" in r} == {"allreduce", "streaming-diloco"}
    compare = next(r for r in gpt if "compare" in r)
    assert compare["bytes_ratio"] > 1 and compare["eval_loss_ratio"] > 0  # int4 syncs every 2 steps, not fp32 every step
    sparse = [r for r in rows if r.get("section") == "sparse"]
    assert {r["run"] for r in sparse if "run" in r} == {"allreduce", "int4", "sparse"}
    verdict = next(r for r in sparse if "compare" in r)
    assert verdict["bytes_ratio_allreduce"] > 1 and {"bits_met", "loss_met", "bytes_met"} <= set(verdict)


def test_a_failure_is_a_row_with_its_traceback_and_the_run_goes_on(capsys, monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench, "CODECS", [("int8", None, False), ("int8:block=0", None, False), ("sign", None, False)])

    def broken(device, plan):
        raise RuntimeError("staging broke")

    monkeypatch.setattr(bench, "measure_staging", broken)
    assert bench.main(["--device", "cpu", "--quick", "--only", "codecs,staging,device"]) == 1
    rows = rows_of(capsys)
    bad = [r for r in rows if "error" in r]
    assert [(r["section"], r.get("codec"), r.get("dtype")) for r in bad] == [
        ("codecs", "int8:block=0", "float32"), ("codecs", "int8:block=0", "bfloat16"), ("staging", "int8", None)]
    assert bad[-1]["error"] == "RuntimeError: staging broke" and "broken" in bad[-1]["traceback"]
    assert sum(1 for r in rows if r.get("codec") in ("int8", "sign") and r.get("ok")) == 4  # its neighbours ran
    assert any(r.get("section") == "device" and "torch" in r for r in rows)  # and the section after it
    # the codecs left out of this run are a failure of their own: every registered codec is measured
    assert rows[-1]["failed"] == ["codecs", "codecs/int8:block=0/float32", "codecs/int8:block=0/bfloat16",
                                  "staging/int8"]
    assert rows[-1]["sections"] == ["codecs", "staging", "device"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda_is_an_error_row_per_section(capsys):
    assert load_bench().main(["--quick", "--only", "device,staging"]) == 1
    bad = [r for r in rows_of(capsys) if "error" in r]
    assert [r["section"] for r in bad] == ["device", "staging"]
    assert all("no CUDA device" in r["error"] for r in bad)


def test_the_sparse_run_alone_is_compared_with_what_ran_beside_it(capsys):
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--quick", "--only", "sparse", "--sparse-runs", "int4,sparse"]) == 0
    sparse = [r for r in rows_of(capsys) if r.get("section") == "sparse"]
    assert [r["run"] for r in sparse if "run" in r] == ["int4", "sparse"]
    verdict = next(r for r in sparse if "compare" in r)
    assert verdict["compare"] == "sparse/int4" and {"loss_gap_int4", "int4_loss_met", "bits_met"} <= set(verdict)
    assert "loss_gap_allreduce" not in verdict and "bytes_met" not in verdict


@pytest.mark.parametrize("argv, message", [(["--only", "device,speed"], "unknown section 'speed'"),
                                           (["--elements", "0"], "--elements must be >= 1"),
                                           (["--sparse-runs", "sparse,dense"], "--sparse-runs takes some of"),
                                           (["--sparse-budget-s", "0"], "--sparse-budget-s must be > 0")])
def test_bad_arguments_are_refused_before_any_run(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        load_bench().main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
