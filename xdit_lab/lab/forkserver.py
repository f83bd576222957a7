"""CPU engines forked from one process that imported the libraries once.

    Lab process ──stdin pipe──▶ fork server (imported torch, transformers, diffusers, ipyparallel's engine)
        │                            │ os.fork() on request, over a unix socket:
        └── ForkedEngineSetLauncher ─┼──▶ engine 0, engine 1, …   each in a session of its own, as ipyparallel's
                                     │                            local launcher starts them
            each engine ─────────────┴──▶ its nanny               with the pipe it watches, handed over the socket

An engine started by ipyparallel's local launcher is a fresh interpreter: before its first `lab.load` it pays
7 core-seconds of imports (torch, transformers, scipy, diffusers), and a Lab of 2 engines on 2 cores waits for
both. Here one fork server per environment pays them once per process, while the controller starts beside it,
and every engine of every Lab that process makes (a restart, the next Lab of a notebook, the test suite's many)
is a fork of it: it starts with the imports done.

Only CPU engines are forked (Lab decides, see cluster.py): a process that initialized CUDA cannot be forked,
and GPU engines keep ipyparallel's launcher. The server never runs torch code (no thread pools, no CUDA) before
it forks; a fork gets the exact environment the local launcher would give it, its own session, output file and
random seeds.

Ending: the server reads its stdin, a pipe from the process that started it: end of input (that process
stopped the server at exit, or was killed) ends the server. Engines end as ipyparallel's engines do (the
cluster stops them by pid, as it would local ones), and the Lab's watchdog ends them if the Lab's process is
killed (processes.py). The server reaps its children as they end, so the launcher sees an engine's end at once.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher, ProcessStateError
from traitlets import Float

# How long a fork request waits for the server to be ready (its imports: ~6 core-seconds, far more on a busy machine).
READY_TIMEOUT_S = 300.0


class ForkServer:
    """One fork server process with the environment `env` (the environment its imports see)."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="xdit-lab-forkserver-")
        self.socket_path = os.path.join(self.dir, "socket")
        self.log_path = os.path.join(self.dir, "server.log")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "xdit_lab.lab.forkserver", self.socket_path],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # a signal to this process's group (a notebook interrupt) does not end it
            )

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, output_file: str) -> int:
        """A new engine process, `python -m ipyparallel.engine *argv` in effect; returns its pid."""
        request = json.dumps(dict(argv=argv, env=env, cwd=cwd, output_file=output_file)).encode() + b"\n"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the engines' fork server ended (exit code {self.process.returncode}): {self.log()}"
                )
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                    connection.settimeout(max(1.0, deadline - time.monotonic()))
                    connection.connect(self.socket_path)
                    connection.sendall(request)
                    answer = json.loads(_read_line(connection))
                break
            except (FileNotFoundError, ConnectionRefusedError):  # not listening yet: it binds first thing
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engines' fork server did not listen in {READY_TIMEOUT_S:g} s") from None
                time.sleep(0.05)
            except TimeoutError:
                raise RuntimeError(
                    f"the engines' fork server did not answer in {READY_TIMEOUT_S:g} s: {self.log()}"
                ) from None
        if "error" in answer:
            raise RuntimeError(f"the engines' fork server could not fork an engine: {answer['error']}")
        return answer["pid"]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as log:
            return log.read()[-2000:] or "(no output)"

    def close(self, timeout_s: float = 10) -> None:
        """End of input: the server exits (engines it forked are not its to stop)."""
        try:
            self.process.stdin.close()
            self.process.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        for name in (self.socket_path, self.log_path):
            if os.path.exists(name):
                os.remove(name)
        os.rmdir(self.dir)


class ForkServers:
    """This process's fork servers, one per import-time environment, kept for the life of the process (every Lab
    it makes reuses them) and closed at its exit."""

    def __init__(self):
        self._servers: dict[frozenset, ForkServer] = {}
        self._closing = False

    def get(self, environment: dict[str, str]) -> ForkServer:
        """The server for os.environ updated with `environment` (ipyparallel's per-cluster IPP_* variables apart:
        they are given to each fork), started now if there is none: its imports run while the caller goes on."""
        env = {k: v for k, v in {**os.environ, **environment}.items() if not k.startswith("IPP_")}
        key = frozenset(env.items())
        server = self._servers.get(key)
        if server is None or server.process.poll() is not None:
            if not self._servers:
                atexit.register(self.close)
            server = self._servers[key] = ForkServer(env)
        return server

    def pids(self) -> list[int]:
        return [server.process.pid for server in self._servers.values()]

    def close(self) -> None:
        servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.close()


FORK_SERVERS = ForkServers()


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine, forked from the fork server of its environment; otherwise ipyparallel's local engine launcher
    (the same arguments, environment, output file, and stop: SIGTERM, then SIGKILL, by pid)."""

    def start(self):
        if self.state != "before":
            raise ProcessStateError(f"the engine was already started and has state: {self.state}")
        env = {**os.environ, **self.get_env()}
        argv = self.args[len(self.engine_cmd) :]  # what follows `python -m ipyparallel.engine`
        self.pid = FORK_SERVERS.get(self.environment).fork(argv, env, os.path.abspath(self.work_dir), self.output_file)
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()  # psutil polls a process that is not our child; the server reaps it at once


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """n forked engines (ForkedEngineLauncher); ipyparallel's pause between engines is not needed (the Lab numbers
    ranks by sorted engine id, not by start order)."""

    launcher_class = ForkedEngineLauncher
    delay = Float(0.0, config=True, help="seconds between starting each engine after the first")


# ---- the server process ------------------------------------------------------------------------------------------


def _read_line(connection: socket.socket) -> bytes:
    return _read_request(connection)[0]


def _read_request(connection: socket.socket) -> tuple[bytes, list[int]]:
    """One line, and the file descriptors that came with its first bytes (a nanny's pipe and output)."""
    data, fds, _, _ = socket.recv_fds(connection, 65536, 2)
    while not data.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            raise ConnectionError("the connection closed before a whole line came")
        data += chunk
    return data, fds


def _preload() -> None:
    """What every engine imports before its first load is done: ipyparallel's engine, torch, this package's
    engine functions and loading, and the diffusers and transformers classes that a load of the bundled digits
    model resolves (both libraries import lazily, on first use). Imports only: no torch code runs here."""
    import importlib

    import ipyparallel.engine.app  # noqa: F401
    import torch  # noqa: F401

    import xdit_lab.lab.engine  # noqa: F401
    import xdit_lab.pipeline  # noqa: F401
    import xdit_lab.run  # noqa: F401
    import xdit_lab.session  # noqa: F401
    from xdit_lab.digits import DIGITS_DIR

    with open(os.path.join(DIGITS_DIR, "model_index.json")) as file:
        index = json.load(file)
    classes = [("diffusers", index["_class_name"])]
    classes += [value for value in index.values() if isinstance(value, list) and len(value) == 2]
    for library, name in classes:
        if library in ("diffusers", "transformers"):
            getattr(importlib.import_module(library), name)


def _become_engine(request: dict) -> int:
    """In the fork: a session, output file, working folder and environment of its own, then the engine."""
    import random

    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the engine waits for its own children
    with open(request["output_file"], "ab") as output, open(os.devnull, "rb") as nothing:
        os.dup2(nothing.fileno(), 0)
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fork would otherwise share the server's random state with every other fork
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [sys.executable, *request["argv"]]
    try:
        from ipyparallel.engine import app

        app.start_nanny = _nanny_forked_by(request["socket_path"])  # in this fork's own copy of the module
        app.IPEngine.launch_instance(argv=request["argv"])
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1


def _reap(signum, frame) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _nanny_forked_by(socket_path: str):
    """A stand-in for ipyparallel's `start_nanny(**kwargs)` (engine/nanny.py), which starts the nanny (the process
    beside each engine that relays signals and reports the engine's end to the hub at once) as a fresh interpreter:
    0.5 to 1 s of each engine's start here. This one asks the server to fork it, with ipyparallel's own arguments
    and the pipe the nanny watches, and answers as ipyparallel's does: the nanny's address, and what keeps it."""
    import base64
    import pickle

    def start_nanny(**kwargs):
        kwargs["pid"] = os.getpid()
        read, write = os.pipe()
        request = json.dumps(dict(nanny=base64.b64encode(pickle.dumps(kwargs)).decode())).encode() + b"\n"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(READY_TIMEOUT_S)
                connection.connect(socket_path)
                socket.send_fds(connection, [request], [write, 2])
                answer = json.loads(_read_line(connection))
        finally:
            os.close(write)
        if "error" in answer:
            raise RuntimeError(f"nanny failed: {answer['error']}")
        pipe = os.fdopen(read, "r")
        nanny_url = pipe.readline().strip()
        if not nanny_url:
            raise RuntimeError("nanny failed")
        return nanny_url, pipe  # the nanny ends when this pipe closes (this engine's end), as ipyparallel's

    return start_nanny


def _become_nanny(request: dict, fds: list[int]) -> int:
    """In the fork: ipyparallel's nanny for an engine, writing its address to the engine's pipe (fds[0]), its log
    to the engine's output (fds[1])."""
    import base64
    import pickle

    from ipyparallel.engine.nanny import KernelNanny

    pipe, output = fds
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    with open(os.devnull, "rb") as nothing:
        os.dup2(nothing.fileno(), 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    kwargs = pickle.loads(base64.b64decode(request["nanny"]))
    KernelNanny.main(**kwargs, pipe=os.fdopen(pipe, "w", buffering=1))  # line-buffered: the address goes at once
    return 0


def serve(socket_path: str) -> None:
    """Bind first (a fork request may connect while the imports run), import, then fork on request until stdin
    ends."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    _preload()
    # Forks are reaped as they end: no zombie for the launcher's wait (psutil's, by pid) to wait on, and their CPU
    # time is added to this process's children's, as a process's own children's is (the test suite counts it).
    signal.signal(signal.SIGCHLD, _reap)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    selector.register(listener, selectors.EVENT_READ, "listener")
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
                continue
            connection, _ = listener.accept()
            fds = []
            with connection:
                try:
                    line, fds = _read_request(connection)
                    request = json.loads(line)
                    pid = os.fork()
                except Exception as error:  # noqa: BLE001 - the launcher reports it
                    connection.sendall(json.dumps(dict(error=f"{type(error).__name__}: {error}")).encode() + b"\n")
                    for fd in fds:
                        os.close(fd)
                    continue
                if pid == 0:
                    code = 1
                    try:
                        selector.close()
                        listener.close()
                        connection.close()
                        if "nanny" in request:
                            code = _become_nanny(request, fds)
                        else:
                            code = _become_engine(dict(request, socket_path=socket_path))
                    except BaseException:  # noqa: BLE001 - into the engine's output file, then out
                        import traceback

                        traceback.print_exc()
                    finally:
                        try:
                            atexit._run_exitfuncs()  # what a normal exit of an engine runs (logging's flush)
                            sys.stdout.flush()
                            sys.stderr.flush()
                        finally:
                            os._exit(code)
                for fd in fds:  # the fork has them
                    os.close(fd)
                connection.sendall(json.dumps(dict(pid=pid)).encode() + b"\n")


if __name__ == "__main__":
    serve(sys.argv[1])
