"""tests/cli_zygote.py: a command forked from the zygote prints, exits, takes signals and
sees its working directory and environment as `python -m starling.cli.main` does."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_zygote import _ForkedProcess, _startup_view, _Zygote, cli_popen, cli_run

CLI = [sys.executable, "-m", "starling.cli.main"]


@pytest.mark.parametrize("args, env", [
    (["--version"], {}),
    (["no-such-command"], {}),  # exit 2 and click's one line
    (["node", "status", "nonsense"], {}),  # starling's one clear line
    (["keygen", "--out", "key"], {"COLUMNS": "50"}),  # written in the working directory
    (["node", "start", "--help"], {"COLUMNS": "50"}),  # wrapped at the environment's width
])
def test_a_forked_command_prints_writes_and_exits_as_the_execd_one(args, env, tmp_path):
    runs = []
    for run, where in ((subprocess.run, tmp_path / "exec"), (cli_run, tmp_path / "fork")):
        where.mkdir()
        done = run(CLI + args, capture_output=True, text=True, timeout=120, cwd=where, env={**os.environ, **env})
        runs.append((done.returncode, done.stderr, sorted(p.name for p in where.iterdir()),
                     done.stdout if args[0] != "keygen" else len(done.stdout)))  # keygen prints a new peer id
    assert runs[0] == runs[1]


def test_a_forked_node_is_its_own_process_and_takes_signals_as_one(tmp_path):
    started = []
    try:
        for _ in range(3):
            proc = cli_popen(CLI + ["node", "start", "--plaintext"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
            started.append(proc)
            assert isinstance(proc, _ForkedProcess)
            assert "join with:" in proc.stdout.readline()
        zygote = _Zygote.get(_startup_view(os.environ)).proc.pid
        assert len({p.pid for p in started} | {os.getpid(), zygote}) == 5
        assert all(os.getpgid(p.pid) == os.getpgid(0) for p in started)  # in this process group, as Popen's are
        assert all(Path(f"/proc/{p.pid}/cwd").resolve() == tmp_path.resolve() for p in started)

        stopped, killed, ended = started
        stopped.send_signal(signal.SIGSTOP)
        killed.kill()
        assert killed.wait(60) == -signal.SIGKILL
        assert stopped.poll() is None  # stopped, not ended
        stopped.send_signal(signal.SIGCONT)
        ended.send_signal(signal.SIGTERM)  # `node start` leaves the swarm and exits 0
        assert ended.wait(60) == 0
        with pytest.raises(subprocess.TimeoutExpired):
            stopped.wait(0.2)
        stopped.terminate()
        assert stopped.wait(60) == 0
    finally:
        for proc in started:
            proc.kill()
            proc.wait(60)
            proc.stdout.close()


CODE = ("import os, sys\n"
        "print(sys.argv, sys.path[0] == '', '__file__' in globals(), os.getcwd() == os.environ['HERE'])\n"
        "open('written', 'w').write(__name__)\n"
        "sys.exit(int(sys.argv[1]))\n")


@pytest.mark.parametrize("code", ["3", "0"])
def test_forked_code_runs_exits_and_writes_as_python_c_does(code, tmp_path):
    runs = []
    for run, where in ((subprocess.run, tmp_path / "exec"), (cli_run, tmp_path / "fork")):
        where.mkdir()
        done = run([sys.executable, "-c", CODE, code, "x"], capture_output=True, text=True, timeout=120, cwd=where,
                   env={**os.environ, "HERE": str(where)})
        runs.append((done.returncode, done.stdout, done.stderr, (where / "written").read_text()))
    assert runs[0] == runs[1] == (int(code), f"['-c', '{code}', 'x'] True False True\n", "", "__main__")
    forked = cli_popen([sys.executable, "-c", "pass"])
    assert isinstance(forked, _ForkedProcess) and forked.wait(120) == 0
    crashed = cli_run([sys.executable, "-c", "raise ValueError('no')"], capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 1 and crashed.stderr.rstrip().endswith("ValueError: no")


def test_what_the_zygote_cannot_reproduce_runs_as_a_plain_subprocess():
    script = cli_popen([sys.executable, "-I", "-c", "pass"])  # an interpreter option
    threads = cli_popen(CLI + ["--version"], stdout=subprocess.DEVNULL,  # read when torch is imported
                        env={**os.environ, "OMP_NUM_THREADS": "3"})
    session = cli_popen(CLI + ["--version"], stdout=subprocess.DEVNULL, start_new_session=True)
    for proc in (script, threads, session):
        assert type(proc) is subprocess.Popen
        assert proc.wait(120) == 0


@pytest.mark.slow
def test_when_this_processs_environment_changes_a_new_zygote_forks_and_the_old_one_still_reports(
        monkeypatch, tmp_path):
    first = cli_popen(CLI + ["node", "start", "--plaintext"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                      text=True)
    try:
        assert "join with:" in first.stdout.readline()
        old = _Zygote.get(_startup_view(os.environ))
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # as torch sets it, in this process
        second = cli_popen(CLI + ["--version"], stdout=subprocess.PIPE, text=True)
        assert isinstance(second, _ForkedProcess)
        assert second.communicate(timeout=60)[0].startswith("starling ") and second.returncode == 0
        assert _Zygote.get(_startup_view(os.environ)) is not old
        assert old.proc.poll() is None  # retired, waiting for its child
        first.terminate()
        assert first.wait(60) == 0  # its exit status, from the retired zygote
        assert old.proc.wait(60) == 0  # which then ends
    finally:
        first.kill()
        first.wait(60)
        first.stdout.close()
