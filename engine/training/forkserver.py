"""A warm process that trainers and a split request's ranks are forked from: torch and diffusers imported once.

A trainer child started as ``python -m engine.training.child`` spends 4-7 s importing
torch, diffusers, transformers and peft before its first step, every run, and each rank
of a split request (:mod:`engine.service.ranks`) as much before it loads its copy of the
model. On Linux the engine keeps one fork server per engine process instead (``python -m
engine.training.forkserver``): it imports those once, then forks a trainer per run and a
rank per rank of each split request (:data:`ENTRIES`), which start with them already
imported. It is the pattern of torch's own DataLoader workers (forked from a process
that imported torch) and of multiprocessing's ``forkserver``, which is not used here for
the reason :mod:`engine.training.child` gives (its children re-run the host's ``__main__``).

What a trainer keeps from :mod:`engine.training.lineage`'s rules, and how:

* **It dies with the engine.** The server asks for SIGKILL when the engine's keeper
  thread goes (``PR_SET_PDEATHSIG``) and exits when its control socket reads EOF; each
  trainer asks for SIGKILL when the server goes and watches its parent PID. So the
  engine's death takes the server, and the server's takes its trainers.
* **It has its own session** (``os.setsid``) and ignores SIGINT, as before.
* **It runs in the engine's present, not the server's past:** each fork request
  carries the engine's environment, working folder and ``sys.path``, and its standard
  output and error as they point now, applied in the trainer before anything runs. What libraries read when they are *imported*
  (thread counts, hub and cache folders, visible devices) cannot be changed after the
  fork, so a request whose :data:`IMPORT_TIME_ENV` variables differ from the server's
  starts a fresh server for it.
* **Its exit code reaches the engine:** the server reaps its trainers (it is their
  parent) and sends each exit status back; a trainer killed by a signal reads as
  ``-signal``, as ``subprocess`` has it.

A forked process cannot initialise CUDA once its parent did, so the server imports
nothing that initialises a GPU: where torch is a CUDA (or ROCm) build it leaves peft
(whose bitsandbytes asks the driver for devices at import) to each trainer, and after
its imports it checks its own memory for a loaded GPU driver; if one is there it says so
and ends, and every later trainer of this process is a fresh interpreter.

Elsewhere (macOS, where forking after its frameworks load is unsafe; Windows, which
has no fork), or with ``DIFFUSION_ENGINE_TRAINER_FORKSERVER=0``, or when the server
cannot start, every trainer is a fresh ``python -m engine.training.child`` as before.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

#: ``0`` turns the fork server off: every trainer is a fresh interpreter.
ENV_SWITCH = "DIFFUSION_ENGINE_TRAINER_FORKSERVER"
#: Environment variables (by prefix) that libraries read when imported: a fork request
#: whose values differ from the server's gets a fresh server.
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "ONEDNN_", "DNNL_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "TORCH",
                   "PYTORCH_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DIFFUSERS_", "TRITON_", "PYTHON", "LD_", "XDG_")
#: What a forked process may become: its name in a fork request -> the module whose
#: ``main(argv)`` it runs, argv being the descriptors it was handed, the request's arguments
#: and the server's PID (its parent, which it dies with).
ENTRIES = {"trainer": "engine.training.child", "rank": "engine.service.rank_worker"}
#: Imported once in every server: the trainer's and the ranks' modules, with torch, diffusers and transformers.
WARM_MODULES = ("engine.training.trainer", *ENTRIES.values())
#: Imported too where torch has no GPU backend (a CPU build): peft, which imports
#: bitsandbytes and torchao, and diffusers' pipeline loader. Where torch has CUDA (or
#: ROCm), bitsandbytes' import asks the driver for its devices, after which a forked
#: process cannot initialise CUDA; those stay for each trainer to import.
CPU_BUILD_WARM_MODULES = ("peft", "diffusers.pipelines.pipeline_utils")
#: Libraries whose presence in the server's memory means a GPU driver was initialised.
GPU_DRIVER_LIBRARIES = ("libcuda.so", "libamdhip64.so", "libhsa-runtime64.so")
#: How long a fork request waits for the server (its first imports included).
FORK_TIMEOUT_S = 300.0


#: Why this process's servers cannot fork trainers ("" while they can): set once a server
#: found a GPU driver initialised by its imports; trainers are fresh interpreters after.
_unusable = ""


def available() -> bool:
    """Whether trainers are forked from a server on this platform and by this setting."""
    return sys.platform.startswith("linux") and os.environ.get(ENV_SWITCH, "1") != "0" and not _unusable


def gpu_driver_touched(maps: str, torch_initialised: bool) -> str:
    """Why a process whose memory map is ``maps`` cannot fork trainers that use the GPU
    ("" where it can): torch initialised its GPU, or a GPU driver library is loaded."""
    if torch_initialised:
        return "torch initialised the GPU while the server imported its modules"
    loaded = sorted({name for name in GPU_DRIVER_LIBRARIES if name in maps})
    if loaded:
        return f"a GPU driver ({', '.join(loaded)}) was loaded while the server imported its modules"
    return ""


def import_time_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The variables of ``environ`` that libraries read when imported."""
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME_ENV)}


class Forked:
    """A trainer forked by the server: what :class:`~engine.training.process.Child`
    needs of a process (``pid``, ``returncode``, ``kill``), its exit reported by the server."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exited = threading.Event()

    def kill(self) -> None:
        if not self.exited.is_set():  # a reaped PID may be another process's by now
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        self.exited.wait(timeout)
        return self.returncode

    def _ended(self, code: int) -> None:
        self.returncode = code
        self.exited.set()


class ForkServer:
    """The engine's side of one server: start it, ask it for a trainer, learn exits."""

    def __init__(self) -> None:
        self.env = import_time_env(os.environ)
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one fork request at a time
        self._replies: list[tuple[str, Any]] = []
        self._reply = threading.Condition()
        self._children: dict[int, Forked] = {}
        self._gone = threading.Event()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def alive(self) -> bool:
        return self._process is not None and not self._gone.is_set()

    def start(self) -> None:
        """Start the server, kept by a thread that reads its messages and so lives as long
        as it (the parent-death signal follows the spawning thread)."""
        from engine.training.lineage import start_kept

        try:
            start_kept("engine.training.forkserver", "diffusion-engine-trainer-forkserver", self._started,
                       ForkServer._read_messages)
        except BaseException:
            self._gone.set()
            raise

    def _started(self, process: subprocess.Popen[bytes], conn: Connection) -> ForkServer:
        self._process, self._conn = process, conn
        return self

    def fork(self, entry: str, fds: tuple[int, ...], args: tuple[str, ...], env: dict[str, str], cwd: str,
             path: list[str]) -> Forked:
        """A process running :data:`ENTRIES` ``[entry]`` with ``fds`` (descriptors of this
        process, handed over) and ``args``, in ``env`` and ``cwd``."""
        if entry not in ENTRIES:
            raise ValueError(f"the fork server runs {sorted(ENTRIES)}, not {entry!r}")
        with self._lock:
            if self._conn is None or self._gone.is_set():
                raise OSError("the trainer fork server is not running")
            server_pid = self.pid
            assert server_pid is not None
            with self._reply:
                self._replies.clear()
            self._conn.send(("fork", entry, len(fds), tuple(args), env, cwd, path))
            outputs, opened = _output_fds()
            try:
                for fd in (*fds, *outputs):  # its descriptors, then where this process writes now
                    send_handle(self._conn, fd, server_pid)
            finally:
                for fd in opened:
                    os.close(fd)
            with self._reply:
                if not self._reply.wait_for(lambda: bool(self._replies) or self._gone.is_set(),
                                            timeout=FORK_TIMEOUT_S):
                    raise OSError(f"the trainer fork server did not answer in {FORK_TIMEOUT_S:.0f} s")
                if not self._replies:
                    raise OSError(f"the trainer fork server ended before it forked the {entry}")
                kind, value = self._replies.pop(0)
            if kind != "forked":
                raise OSError(f"the trainer fork server could not fork: {value}")
            return self._children[int(value)]

    def stop(self) -> None:
        """End the server (its trainers end with it)."""
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        if self._process is not None:
            with contextlib.suppress(OSError):
                self._process.kill()

    def _read_messages(self) -> None:
        assert self._conn is not None and self._process is not None
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "exited":
                    child = self._children.get(int(message[1]))
                    if child is not None:
                        child._ended(int(message[2]))
                    continue
                if message[0] == "unusable":  # the server ends: trainers are fresh interpreters from now on
                    global _unusable
                    _unusable = str(message[1])
                    continue
                if message[0] == "forked":  # registered before the requester sees it
                    self._children[int(message[1])] = Forked(int(message[1]))
                with self._reply:
                    self._replies.append((message[0], message[1]))
                    self._reply.notify_all()
        except (EOFError, OSError):
            pass
        finally:
            self._gone.set()
            with contextlib.suppress(OSError):
                self._process.wait()
            for child in self._children.values():  # killed with the server (its parent-death signal)
                if not child.exited.is_set():
                    child._ended(-signal.SIGKILL)
            with self._reply:
                self._reply.notify_all()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def server() -> ForkServer:
    """This engine process's server, started (or restarted) for the present environment."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive() or _server.env != import_time_env(os.environ):
            if _server is not None:
                _server.stop()
            _server = ForkServer()
            _server.start()
        return _server


def fork_if_available(entry: str, fds: tuple[int, ...], args: tuple[str, ...], env: dict[str, str]) -> Forked | None:
    """:data:`ENTRIES` ``[entry]`` forked from this process's server, in the present working folder
    and ``sys.path``; None where no server can be had (another platform, the switch off, a
    server that could not start): the caller starts a fresh interpreter instead."""
    if not available():
        return None
    try:
        return server().fork(entry, fds, args, env, os.getcwd(), [p for p in sys.path if p])
    except OSError:
        return None


def prewarm() -> None:
    """Start the server now, so its imports overlap the caller's own work (the CLI's)."""
    if available():
        with contextlib.suppress(OSError):
            server()


# -- the server process ----------------------------------------------------------------


def main(argv: list[str]) -> int:
    """``python -m engine.training.forkserver FD ENGINE_PID``: import, then fork on request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, engine_pid = int(argv[0]), int(argv[1])
    from engine.runtime import heap
    from engine.training.lineage import ORPHAN_EXIT, set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != engine_pid:
        return ORPHAN_EXIT
    conn = Connection(fd)
    from engine.logs import quiet_library_logs

    quiet_library_logs(progress_bars=False)
    import torch

    cpu_build = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    for module in WARM_MODULES + (CPU_BUILD_WARM_MODULES if cpu_build else ()):
        importlib.import_module(module)
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        unusable = gpu_driver_touched(maps.read(), torch.cuda.is_initialized())
    if unusable:
        conn.send(("unusable", unusable))
        return 0
    heap.settle()  # frozen before forking (Python's advice): no child's collection walks or copies it
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: _poke(wake_write))
    while True:
        ready = wait_ready([conn, wake_read])
        if wake_read in ready:
            os.read(wake_read, 512)
        _reap(conn)
        if conn not in ready:
            continue
        try:
            _, entry, count, args, env, cwd, path = conn.recv()
            handles = tuple(recv_handle(conn) for _ in range(count))
            stdout, stderr = recv_handle(conn), recv_handle(conn)
        except (EOFError, OSError):
            return 0  # the engine is gone; its trainers end with this process
        settled_read, settled_write = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            pid = -1
        if pid == 0:
            _become(ENTRIES[entry], [*map(str, handles), *args], env, cwd, path, outputs=(stdout, stderr),
                    settled=settled_write, close=(conn.fileno(), wake_read, wake_write, settled_read))
        for fd in (*handles, stdout, stderr, settled_write):
            os.close(fd)
        if pid > 0:
            with contextlib.suppress(OSError):
                os.read(settled_read, 1)  # EOF once the trainer has its own session (or has died)
            conn.send(("forked", pid))
        os.close(settled_read)


def _output_fds() -> tuple[list[int], list[int]]:
    """This process's standard output and error as they point now (a test runner may
    have redirected them since the server started), or the null device where one is
    closed; and the descriptors opened here for that, to close once sent."""
    fds, opened = [], []
    for fd in (1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:  # closed: the trainer writes nowhere, as a spawned one would
            opened.append(os.open(os.devnull, os.O_WRONLY))
            fds.append(opened[-1])
    return fds, opened


def _poke(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, b"c")


def _reap(conn: Connection) -> None:
    """Report every trainer that has ended (this process is their parent)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))


def _become(module: str, argv: list[str], env: dict[str, str], cwd: str, path: list[str], *,
            outputs: tuple[int, int], settled: int, close: tuple[int, ...]) -> None:
    """In the forked process: a session of its own (then ``settled`` is closed, which the
    server waits for), the engine's present, ``module``'s ``main(argv + [server PID])``;
    never returns."""
    code = 1
    try:
        os.setsid()  # before the engine hears of it, as Popen's start_new_session
        os.close(settled)
        for fd, target in zip(outputs, (1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
        code = importlib.import_module(module).main([*argv, str(os.getppid())]) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - whatever it was, the trainer ends here with its traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
