"""The Lab's engine processes: how many start, with which environment (engine_plan), and that they
end with the process that made the Lab, even one that is killed (the rest of this module).

A Lab that is never stopped still ends with the process that made it: on a normal exit (the
kernel shut down or restarted) an atexit handler stops it. When that process is killed outright
(nbval ends its kernels with SIGKILL, so does an out-of-memory kill, and a kernel that takes too
long to shut down) no handler runs, or not to the end, and the engines and controller, which
ipyparallel starts in sessions of their own, would outlive it: a small watchdog process, which
notices when the Lab's process is gone, ends them.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import traceback
import weakref


def cpu_engines(gpus: int, backend: str | None) -> bool:
    """Whether the Lab's engines run on CPU (gloo): no GPU visible, or backend="gloo" asked for CPU engines."""
    return backend == "gloo" or not gpus


def engine_plan(
    n: int | None, gpus: int, backend: str | None, cpu_cores: int, engine_env: dict | None = None
) -> tuple[int, dict]:
    """How many engines to start, and their environment: one per GPU (at most one per GPU: NCCL
    refuses two ranks on one), or CPU engines over gloo when there are no GPUs or backend="gloo"
    asks for them (any number; the GPUs are hidden from them, one torch thread each)."""
    cpu = cpu_engines(gpus, backend)
    if not cpu and backend not in (None, "nccl"):
        raise ValueError(f"backend {backend!r}: choose 'nccl' (one engine per GPU), 'gloo' (CPU engines) or None")
    if not cpu and n is not None and n > gpus:
        raise ValueError(
            f"{n} engines but {gpus} visible GPUs: one engine per GPU (n <= {gpus}), or CPU engines "
            f"with Lab(n={n}, backend='gloo')"
        )
    n = n or (cpu_cores if cpu else gpus)
    # One thread per CPU engine from the start (torch reads these at import); init sets it again.
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""} if cpu else {}
    return n, {**env, **(engine_env or {})}


# The watchdog, run as `python -c WATCHDOG <cluster file>`: the Lab writes the pid of each process
# of its cluster to its stdin, one per line. End of input means the Lab stopped, or its process
# is gone, perhaps killed: whatever of those processes and their children still runs is ended
# (psutil refuses a pid that now names another process), and a stale cluster file removed.
WATCHDOG = """
import os, sys
import psutil

watched = []
for line in sys.stdin:
    try:
        process = psutil.Process(int(line))
        watched += [process, *process.children(recursive=True)]  # schedulers, an engine's nanny
    except psutil.Error:
        pass
for process in watched:
    try:
        process.terminate()
    except psutil.Error:
        pass
for process in psutil.wait_procs(watched, timeout=5)[1]:
    try:
        process.kill()
    except psutil.Error:
        pass
if os.path.exists(sys.argv[1]):
    os.remove(sys.argv[1])
"""

_running: weakref.WeakSet = weakref.WeakSet()  # Labs not stopped yet, for the atexit handler


def _stop_running_labs() -> None:
    for lab in list(_running):
        try:
            lab.stop()
        except Exception:  # noqa: BLE001 - at exit: say so, and go on to the next Lab
            traceback.print_exc()


def stop_at_exit(lab) -> None:
    """Stop `lab` when this process exits, before ipyparallel's own handler would (it stops the
    cluster too, but printing every engine's log): atexit runs the last registered first."""
    _running.add(lab)
    atexit.unregister(_stop_running_labs)
    atexit.register(_stop_running_labs)


def forget_at_exit(lab) -> None:
    """`lab` has stopped: nothing to do for it at exit."""
    _running.discard(lab)


class Watchdog:
    """The watchdog process (see WATCHDOG), in a session of its own so that a signal to this
    process's group (a kernel being killed) does not end it too; its output goes to `log_path`."""

    def __init__(self, cluster_file: str, log_path: str):
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "ab") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-c", WATCHDOG, cluster_file],
                stdin=subprocess.PIPE,
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def watch(self, pids) -> None:
        """Hand processes of the cluster to the watchdog."""
        self.process.stdin.write("".join(f"{pid}\n" for pid in pids))
        self.process.stdin.flush()

    def close(self, timeout_s: float = 15) -> None:
        """End of input: the watchdog ends what still runs of the cluster, then exits."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
