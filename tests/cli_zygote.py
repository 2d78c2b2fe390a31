"""Processes for the tests, forked from one that imported torch and starling once.

A process that trains spends about 4 s of CPU on imports before it does anything (torch, then
torch._dynamo, which torch imports at the first optimizer call, then starling), and the suite
starts dozens of them (every `starling node start` a test runs) on a 2-core box. `cli_popen`
and `cli_run` are `subprocess.Popen` and `subprocess.run` for `[sys.executable, "-m",
"starling.cli.main", ...]`, `[sys.executable, "/abs/script.py", ...]` or `[sys.executable, "-c",
CODE, ...]`: each test process (each xdist worker) starts one zygote, a helper process that
imports those modules and then waits, single-threaded, with no ZeroMQ context, no torch thread
pool and CUDA untouched; for each command it forks a child that runs the module as `python -m`
does (`runpy`, `sys.argv`, `sys.path[0]` the working directory, `__main__` the CLI module, so a
multiprocessing spawn from it starts the same way), the script as `python SCRIPT` does, or the
code as `python -c` does, with the caller's stdin, stdout and stderr (pipes, DEVNULL, a pty, or
the caller's own), environment, working directory and, if asked, network namespace, and that
exits as the interpreter would: non-daemon threads joined, atexit handlers run, the status of a
SystemExit, 1 and a traceback for an uncaught
exception, killed by SIGINT for an uncaught KeyboardInterrupt.

The child is a real process with its own pid, in the caller's process group: tests signal it,
SIGKILL or SIGSTOP it, read its pipes, and wait for its exit status through the usual `Popen`
methods (the zygote, its parent, reaps it and passes the wait status on). What differs from an
exec'd process: its parent is the zygote, not the test process; its command line in /proc is
the zygote's; what the zygote imported is imported already (a script that must show it runs
without torch cannot run here, and import-time warnings are not printed again), and its hash
seed is the zygote's. A command that must differ in any of these runs as a plain subprocess:
`cli_popen` falls back to `subprocess.Popen` for any other argv (interpreter options, another
interpreter, the installed `starling` script), for options the zygote does not reproduce
(preexec_fn, start_new_session, process_group, pass_fds, close_fds=False, shell, executable,
user and group changes), for an environment that differs from the zygote's in a variable read
at start-up or import (`STARTUP_VARIABLES`), where Linux's pidfd is missing, and everywhere
when STARLING_TEST_ZYGOTE=0.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

MODULE = "starling.cli.main"
# Imported in the zygote: what `node start`, `node status` and `simulate` import lazily, and
# torch._dynamo, which torch imports at a process's first optimizer call (2 s of CPU more).
PRELOAD = ("torch._dynamo", "starling.cli.main", "starling.node.node", "starling.node.client", "starling.node.transfer",
           "starling.protocols", "starling.runtime", "starling.runtime.metrics", "starling.runtime.placement",
           "starling.runtime.replica_launch", "starling.runtime.sim_processes", "starling.tasks",
           "starling.cli.plot")
# Read once when a process starts or imports what the zygote imported: a command whose
# environment differs from the zygote's in one of these runs as a plain subprocess.
STARTUP_VARIABLES = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_", "TORCH", "PYTORCH", "CUDA_",
                     "NVIDIA_", "LD_", "MALLOC_", "GLIBC_", "LANG", "LC_", "HOME", "MPL", "NUMEXPR_",
                     "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TYPER_", "_TYPER_", "STARLING_TEST_ZYGOTE")
OFF_ENV = "STARLING_TEST_ZYGOTE"
_UNSUPPORTED = ("preexec_fn", "start_new_session", "process_group", "pass_fds", "shell", "executable", "user",
                "group", "extra_groups", "umask", "startupinfo", "creationflags")
_HEADER = struct.Struct("!I")
_STATUS = struct.Struct("!i")


# ------------------------------------------------------------------------------------- the caller side
def cli_popen(args: Sequence[str], netns: str | None = None, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)`; forked from the zygote when `args` runs the CLI
    (`[sys.executable, "-m", "starling.cli.main", ...]`), a script given by its absolute path
    (`[sys.executable, "/abs/script.py", ...]`) or code (`[sys.executable, "-c", CODE, ...]`) and nothing in `kwargs` needs an exec. `netns`:
    run it in that network namespace, as `ip netns exec NETNS` would (the zygote's child enters
    it with setns before it runs anything)."""
    zygote = _zygote_for(args, kwargs)
    if zygote is None:
        return subprocess.Popen([*(["ip", "netns", "exec", netns] if netns else []), *args], **kwargs)
    return _ForkedProcess(args, zygote=zygote, netns=netns, **kwargs)


def cli_run(args: Sequence[str], *, input=None, capture_output: bool = False, timeout: float | None = None,
            check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(args, ...)` through `cli_popen`."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with cli_popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
        if check and code:
            raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, code, stdout, stderr)


def _zygote_for(args: Sequence[str], kwargs: Mapping) -> _Zygote | None:
    if os.environ.get(OFF_ENV, "1") == "0" or not hasattr(os, "pidfd_open"):
        return None
    if isinstance(args, (str, bytes, os.PathLike)) or _program(args) is None:
        return None
    if any(kwargs.get(name) for name in _UNSUPPORTED) or not kwargs.get("close_fds", True) \
            or not kwargs.get("restore_signals", True):
        return None
    env = kwargs.get("env")
    return _Zygote.get(_startup_view(os.environ if env is None else env))


def _program(args: Sequence) -> tuple[dict[str, str], list[str]] | None:
    """What `args` runs, as the zygote's child takes it ({"module": MODULE}, {"script": path}
    or {"code": CODE}), and its arguments; None for anything else."""
    args = [os.fsdecode(a) for a in args]
    if len(args) >= 3 and args[:3] == [sys.executable, "-m", MODULE]:
        return {"module": MODULE}, args[3:]
    if len(args) >= 2 and args[0] == sys.executable and args[1].endswith(".py") and os.path.isabs(args[1]) \
            and os.path.isfile(args[1]):
        return {"script": args[1]}, args[2:]
    if len(args) >= 3 and args[:2] == [sys.executable, "-c"]:
        return {"code": args[2]}, args[3:]
    return None


def _startup_view(env: Mapping) -> dict[str, str]:
    env = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
    return {k: v for k, v in env.items() if k.startswith(STARTUP_VARIABLES)}


class _ForkedProcess(subprocess.Popen):
    """A `Popen` whose child the zygote forks: `Popen` makes the pipes and wraps them, and
    reads the child's wait status from the zygote instead of from waitpid."""

    def __init__(self, args, *, zygote: _Zygote, netns: str | None, **kwargs) -> None:
        self._zygote, self._netns, self._conn, self._status = zygote, netns, None, None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       *_rest) -> None:
        try:
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
                   errwrite if errwrite != -1 else 2]
            environ = os.environ if env is None else env
            program, argv = _program(args)
            request = {**program, "argv": argv,
                       "cwd": os.fsdecode(os.path.abspath(cwd if cwd is not None else os.getcwd())),
                       "env": {os.fsdecode(k): os.fsdecode(v) for k, v in environ.items()},
                       "netns": self._netns}
            self._conn, self.pid = self._zygote.fork(request, fds)
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _try_wait(self, wait_flags):
        if self._status is None:
            self._status = _read_status(self._conn, block=not wait_flags & os.WNOHANG, pid=self.pid)
        return (0, 0) if self._status is None else (self.pid, self._status)

    def _internal_poll(self, _deadstate=None, **_unused):
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):
                return None
            try:
                if self.returncode is not None:
                    return self.returncode
                pid, status = self._try_wait(os.WNOHANG)
                if pid == self.pid:
                    self._handle_exitstatus(status)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _handle_exitstatus(self, sts, *args, **kwargs) -> None:
        super()._handle_exitstatus(sts, *args, **kwargs)
        if self._conn is not None:
            self._conn.close()


def _read_status(conn: socket.socket, block: bool, pid: int) -> int | None:
    """The child's wait status as the zygote sent it; None if not yet (when not blocking)."""
    if not block and not select.select([conn], [], [], 0)[0]:
        return None
    data = _recv_exactly(conn, _STATUS.size)
    if data is None:
        raise ChildProcessError(f"the test zygote went away before it reported process {pid}'s exit")
    return _STATUS.unpack(data)[0]


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            return None
        data += part
    return data


class _Zygote:
    """The caller's handle on its zygote process (one per test process, started on first use)."""

    _lock = threading.Lock()
    _current: _Zygote | None = None

    @classmethod
    def get(cls, view: dict[str, str]) -> _Zygote | None:
        """The zygote for a command whose environment's `_startup_view` is `view`; None when
        the command's environment is its own (it must exec). This process's environment may
        change under the zygote (torch sets TORCHINDUCTOR_CACHE_DIR the first time it needs it):
        the zygote is then retired (it ends with its last child) and a new one started."""
        with cls._lock:
            current = cls._current
            if current is not None and (current.owner != os.getpid() or current.proc.poll() is not None):
                current = None
            if current is not None and view == current.startup_env:
                return current
            ours = _startup_view(os.environ)
            if view != ours:
                return None
            if current is not None:
                current.retire()
            cls._current = cls()
            return cls._current

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.folder = tempfile.mkdtemp(prefix="starling-zygote-")
        self.address = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "log"), "w+b")  # the zygote's stderr; closed by stop()
        self.startup_env = _startup_view(os.environ)
        # Started from / with its stdin a pipe it watches: when this process is gone (the pipe's
        # write end closes), the zygote stops; its children run on, as a killed parent's would.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import cli_zygote; "
             "cli_zygote.serve(sys.argv[2])", str(Path(__file__).resolve().parent), self.address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd="/")
        ready = self.proc.stdout.readline()
        if ready.strip() != b"ready":
            self.proc.wait(30)
            self.log.seek(0)
            raise RuntimeError(f"the test zygote did not start: {self.log.read().decode(errors='replace')[-3000:]}")
        atexit.register(self.stop)

    def fork(self, request: dict, fds: list[int]) -> tuple[socket.socket, int]:
        """Send a command to the zygote; the connection its exit status will come on, and its pid."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.address)
            payload = json.dumps(request).encode()
            socket.send_fds(conn, [_HEADER.pack(len(payload))], fds)
            conn.sendall(payload)
            kind = _recv_exactly(conn, 1)
            body = _recv_exactly(conn, _HEADER.size)
            if kind is None or body is None:
                raise ChildProcessError("the test zygote went away while it started a process")
            if kind == b"P":
                return conn, _HEADER.unpack(body)[0]
            size = _HEADER.unpack(body)[0]
            raise OSError(*json.loads(_recv_exactly(conn, size) or b'[0, "no reason given", null]'))
        except BaseException:
            conn.close()
            raise

    def retire(self) -> None:
        """No more commands: the zygote ends once the children it forked have ended."""
        if not self.proc.stdin.closed:
            self.proc.stdin.close()

    def stop(self) -> None:
        """At exit: retire it and wait a little for it to end (a child still running keeps it,
        as a leaked child of an exec'd process runs on)."""
        if self.owner != os.getpid():
            return
        self.retire()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return
        self.proc.stdout.close()
        self.log.close()
        for name in ("socket", "log"):
            Path(self.folder, name).unlink(missing_ok=True)
        os.rmdir(self.folder)


# ------------------------------------------------------------------------------------- the zygote side
def serve(address: str) -> None:
    """The zygote's loop: import once, then fork a child per command and report its exit."""
    import gc
    import importlib

    original_path = [p for p in sys.path if p != str(Path(__file__).resolve().parent)]
    import torch

    rng = torch.random.get_rng_state()  # a fresh process's, before anything draws from it
    for name in PRELOAD:
        importlib.import_module(name)
    import zmq

    if zmq.Context._instance is not None or torch.cuda.is_initialized():
        raise RuntimeError("an import made a ZeroMQ context or initialised CUDA: the zygote cannot fork")
    _check_single_threaded()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    gc.collect()
    gc.freeze()  # what the imports made stays shared with the children, unscanned
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    accepting = True
    while accepting or children:
        readable = select.select([0, listener, *children] if accepting else list(children), [], [])[0]
        for fd in readable:
            if fd == 0:
                # retired, or the test process is gone: no more commands; reap the children
                # still running as they end (each runs on, as a killed parent's would)
                if not os.read(0, 4096):
                    accepting = False
                    listener.close()
            elif fd is listener:
                if not accepting:  # closed just now
                    continue
                conn = listener.accept()[0]
                forked = _fork(conn, listener, children, original_path, rng)
                if forked is not None:
                    pid, pidfd = forked
                    children[pidfd] = (pid, conn)
                else:
                    conn.close()
            else:
                pid, conn = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(_STATUS.pack(status))
                except OSError:
                    pass  # its caller is gone
                conn.close()


def _check_single_threaded() -> None:
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise RuntimeError(f"the zygote has {len(threads)} threads; it must fork from one")


def _fork(conn: socket.socket, listener: socket.socket, children: dict, original_path: list[str],
          rng) -> tuple[int, int] | None:
    conn.settimeout(30)
    try:
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
        if len(header) < _HEADER.size:
            header += _recv_exactly(conn, _HEADER.size - len(header)) or b""
        request = json.loads(_recv_exactly(conn, _HEADER.unpack(header)[0]))
    except (OSError, ValueError, struct.error, TypeError):
        return None
    conn.settimeout(None)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    _check_single_threaded()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(conn, listener, children, fds, request, original_path, rng)
        except BaseException:  # a broken set-up: its traceback on the child's stderr
            import traceback

            os.write(2, traceback.format_exc().encode(errors="replace"))
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    return pid, os.pidfd_open(pid)


def _child(conn: socket.socket, listener: socket.socket, children: dict, fds: list[int], request: dict,
           original_path: list[str], rng) -> int:
    """In the forked child: become `python -m MODULE ARGV` (or `python SCRIPT ARGV`) and return
    its exit status."""
    listener.close()
    for pidfd, (_, other) in children.items():
        os.close(pidfd)
        other.close()
    os.close(0)  # the zygote's lifeline pipe
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    try:
        if request.get("netns"):
            _enter_netns(request["netns"])
        os.chdir(request["cwd"])
    except OSError as exc:
        message = json.dumps([exc.errno, exc.strerror, exc.filename]).encode()
        conn.sendall(b"E" + _HEADER.pack(len(message)) + message)
        return 255
    conn.sendall(b"P" + _HEADER.pack(os.getpid()))
    conn.close()
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_stdio()
    _fresh_random(rng)
    _fresh_process_state(request["cwd"])
    interrupted = False
    try:
        _run_main(request, original_path)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    code = _finalize(code)
    if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _run_main(request: dict, original_path: list[str]) -> None:
    """Run the request's module as `python -m` does, its script as `python SCRIPT` does, or its
    code as `python -c CODE` does."""
    import runpy

    script, code = request.get("script"), request.get("code")
    if code is not None:  # as `python -c CODE` runs it: no __file__, the working directory first on the path
        sys.path[:] = ["", *original_path[1:]]
        sys.argv = ["-c", *request["argv"]]
        sys.orig_argv = [sys.executable, "-c", code, *request["argv"]]
        main = sys.modules["__main__"].__dict__
        main.pop("__file__", None)
        main.update(__name__="__main__", __doc__=None, __spec__=None, __package__=None, __cached__=None)
        exec(compile(code, "<string>", "exec"), main)
        return
    if script is None:
        module = request["module"]
        sys.path[:] = [request["cwd"], *original_path[1:]]
        sys.argv = ["-m", *request["argv"]]
        sys.orig_argv = [sys.executable, "-m", module, *request["argv"]]
        # `python -m` runs the module's code as __main__ without importing it first: the zygote's
        # import goes (what it imported stays), so runpy runs it as a fresh process does
        sys.modules.pop(module, None)
        package, _, leaf = module.rpartition(".")
        if hasattr(sys.modules.get(package), leaf):
            delattr(sys.modules[package], leaf)
        runpy._run_module_as_main(module)
        return
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *original_path[1:]]
    sys.argv = [script, *request["argv"]]
    sys.orig_argv = [sys.executable, script, *request["argv"]]
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec")
    runpy._run_code(code, sys.modules["__main__"].__dict__, None, "__main__", None, None, script)


def _enter_netns(name: str) -> None:
    """This process into network namespace `name` (`ip netns add`'s), as `ip netns exec` does."""
    import ctypes

    fd = os.open(os.path.join("/var/run/netns", name), os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}", name)
    finally:
        os.close(fd)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    try:
        print(exc.code, file=sys.stderr)
    except Exception:
        pass  # as the interpreter: the status is what matters
    return 1


def _finalize(code: int) -> int:
    """What the interpreter does on its way out: join non-daemon threads, run atexit, flush."""
    import atexit as atexit_module

    try:
        threading._shutdown()
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    atexit_module._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # the interpreter exits 120 when stdout cannot be flushed
            if stream is sys.stdout and code == 0:
                code = 120
    return code


def _fresh_stdio() -> None:
    """sys.stdin, stdout and stderr made for the new fds 0-2 as the interpreter makes them at
    start-up (a tty's stdout is line-buffered; -u or PYTHONUNBUFFERED writes through)."""
    buffered = not sys.__stderr__.write_through  # the interpreter's -u, as the zygote started
    for fd, name, old in ((0, "stdin", sys.__stdin__), (1, "stdout", sys.__stdout__), (2, "stderr", sys.__stderr__)):
        write = fd != 0
        try:
            os.fstat(fd)
        except OSError:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        buffering = 0 if (write and not buffered) else -1
        buf = open(fd, "wb" if write else "rb", buffering, closefd=False)
        raw = buf.raw if buffering else buf
        raw.name = f"<{name}>"
        stream = io.TextIOWrapper(buf, encoding=old.encoding if old else None, errors=old.errors if old else None,
                                  newline="\n", line_buffering=buffered and (raw.isatty() or fd == 2),
                                  write_through=not buffered)
        stream.mode = "w" if write else "r"
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_process_state(cwd: str) -> None:
    """What modules the zygote imported read from the process lazily and keep: read again."""
    import multiprocessing.process
    import tempfile as tempfile_module

    tempfile_module.tempdir = None  # TMPDIR, read at the first gettempdir()
    multiprocessing.process.ORIGINAL_DIR = cwd  # the directory at start-up, which spawn hands on


def _fresh_random(rng) -> None:
    """The random state a fresh process starts with: `random` reseeds itself after a fork;
    numpy's global generator and torch's default one are set here."""
    import torch

    torch.random.set_rng_state(rng)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
