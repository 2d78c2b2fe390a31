"""A simulation killed outright (SIGKILL: a CI timeout, the OOM killer) leaves no worker
behind: each worker watches its parent and ends when it is gone (common/lifeline.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_zygote import cli_popen
from conftest import wait_until

from starling.common.lifeline import die_with_parent

pytestmark = pytest.mark.slow


def _children(pid: int) -> set[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (a container's init may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_simulation_killed_with_sigkill_leaves_no_worker_alive():
    """Killed while its workers form their swarm, where they read nothing from the parent for
    seconds: before the lifeline, such a run's workers outlived it by about 10 s, and at
    1024 peers for more than 13 minutes."""
    proc = cli_popen([sys.executable, "-m", "starling.cli.main", "simulate", "--peers", "96", "--processes", "2",
                      "--protocol", "gossip", "--task", "quadratic", "--steps", "1000000"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def workers() -> set[int]:  # the fork server's children
        return {w for child in _children(proc.pid) for w in _children(child)}

    try:
        # both workers up (forks of the simulator's fork server), and busy forming their swarm
        assert wait_until(lambda: len(workers()) >= 2, timeout_s=120), _children(proc.pid)
        forked = workers()
        assert wait_until(lambda: sum(_cpu_s(w) for w in forked) > 3.0, timeout_s=120)
        everything = forked | _children(proc.pid)  # with the fork server and the resource tracker
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # within 10 s, as the lifeline promises (it polls every 0.5 s; a starved CI box schedules the
    # poll and the exit seconds late)
    assert wait_until(lambda: not any(_alive(w) for w in everything), timeout_s=10), \
        [w for w in everything if _alive(w)]


def test_die_with_parent_ends_a_process_whose_parent_is_gone():
    """The lifeline itself, in a grandchild: its parent exits at once, and it follows."""
    script = ("import os, sys, time\n"
              "from starling.common.lifeline import die_with_parent\n"
              "if os.fork() == 0:\n"
              "    die_with_parent(poll_s=0.05)\n"
              "    print(os.getpid(), flush=True)\n"
              "    time.sleep(60)\n"
              "    sys.exit(0)\n"
              "time.sleep(1.0)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    grandchild = int(out.stdout.split()[0])
    assert wait_until(lambda: not _alive(grandchild), timeout_s=10)


def test_die_with_parent_follows_nobody_where_there_is_no_parent_to_follow():
    assert die_with_parent(parent_pid=1) is None  # adopted by init already: nothing to follow
