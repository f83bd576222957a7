"""run_on_ranks: run a function on N real processes over gloo, from pytest or a script.

    results = run_on_ranks(check_all_reduce, 4, ParallelConfig(ulysses=2, ring=2))

Each child joins a fresh process group through a store this process serves (distributed.serve_store), calls
`fn(*args, **kwargs)` and sends back its return value (anything picklable; tensors are fine).
The parent waits at most `timeout_s`; a child that raises has its traceback re-raised in the
parent as `RankFailure`, and a child that hangs or dies is killed and reported the same way.

Children come from a forkserver that has already imported torch and diffusers, so a 4-rank
test pays the ~3 s import once, not once per rank and per test. Where CUDA is visible they are
spawned instead: importing diffusers asks CUDA for its devices, and torch then refuses CUDA in
every process forked after that ("Cannot re-initialize CUDA in forked subprocess").

run_cli: the console script's own entry point (`xdit-lab ARGV`) on N ranks, each given the environment torchrun
gives its ranks, its stdout, stderr and exit code kept:

    job = run_cli(["run", "--model", "digits", "--prompt", "a 7", "--ulysses", "2", "--output", out], 2)
    assert job.codes == [0, 0], job

The ranks are forks of one agent process (as torchrun's ranks are children of its agent), so an error said once
per job (launch.say_once, keyed by the ranks' parent) is said once here too, and the CLI's flags are checked
without starting a torchrun and a fresh interpreter per rank (~7 core-seconds each). What only torchrun proves
(its rendezvous, several nodes, a rank killed under it) needs torchrun itself.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

from .distributed import AGENT_STORE, serve_store

_CONTEXT = None
# diffusers imports its models and pipelines lazily, on a class's first use: about 2 s of CPU that
# every rank of every run would pay again (4 ranks share 2 cores here). The forkserver pays it once.
# xdit_lab first: its import filters the log lines torchao's presence prints (quantization.FALSE_ALARMS) before
# diffusers' modeling_utils imports torchao.
PRELOAD = [
    "xdit_lab",
    "torch.distributed",
    "diffusers",
    "diffusers.models.modeling_utils",
    "diffusers.pipelines.pipeline_utils",
]


class RankFailure(RuntimeError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        import torch

        if torch.cuda.is_available():
            _CONTEXT = mp.get_context("spawn")
        else:
            _CONTEXT = mp.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _child(fn, rank, world_size, port, backend, timeout_s, env, args, kwargs, results):
    os.environ.update(env)
    try:
        from xdit_lab.distributed import init_distributed, shutdown_distributed

        init_distributed(
            backend=backend,
            timeout_s=timeout_s,
            rank=rank,
            world_size=world_size,
            local_rank=rank,
            local_world_size=world_size,
            master_addr="127.0.0.1",
            master_port=port,
        )
        try:
            value = fn(*args, **kwargs)
        finally:
            shutdown_distributed()
        # Plain pickle: tensors travel by value. (torch's queue reducers would pass a file
        # descriptor that dies with this process, which may exit before the parent reads it.)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including KeyboardInterrupt and SystemExit
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(
    fn,
    world_size: int,
    *args,
    timeout_s: float = 120,
    backend: str = "gloo",
    collective_timeout_s: float | None = None,
    env: dict | None = None,
    **kwargs,
) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` fresh ranks; return their results in rank order.

    `fn` must be importable by name (a module-level function). `collective_timeout_s` bounds each
    collective inside the children (default: a little under `timeout_s`), so a rank that waits
    for a lost peer fails with torch's own message rather than being killed silently."""
    ctx = _context()
    results = ctx.Queue()
    store = serve_store(world_size)  # kept alive here until every rank is done
    port = store.port
    collective_timeout_s = collective_timeout_s or max(5.0, timeout_s * 0.8)
    env = {"OMP_NUM_THREADS": "1", **(env or {}), **AGENT_STORE}
    procs = [
        ctx.Process(
            target=_child,
            daemon=True,
            name=f"rank{rank}",
            args=(fn, rank, world_size, port, backend, collective_timeout_s, env, args, kwargs, results),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()

    outcomes: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout_s
    trouble_since = None  # when a rank first failed or died: its peers get a short grace, then stop
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            if trouble_since is not None and time.monotonic() - trouble_since > 3:
                break
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_module.Empty:
                died = any(p.exitcode not in (None, 0) for r, p in enumerate(procs) if r not in outcomes)
                if died and trouble_since is None:
                    trouble_since = time.monotonic()
                continue
            outcomes[rank] = (ok, pickle.loads(value) if ok else value)
            if not ok and trouble_since is None:
                trouble_since = time.monotonic()
    finally:
        for proc in procs:
            proc.join(timeout=0.2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    failures = []
    for rank, proc in enumerate(procs):
        if rank not in outcomes:
            if any(not ok for ok, _ in outcomes.values()):
                why = "was stopped after another rank failed"
            elif proc.exitcode in (None, -9):
                why = f"did not finish within {timeout_s:.0f} s (killed)"
            else:
                why = f"died with exit code {proc.exitcode} without reporting"
            failures.append(f"rank {rank} {why}")
        elif not outcomes[rank][0]:
            failures.append(f"rank {rank} raised:\n{outcomes[rank][1]}")
    if failures:
        raise RankFailure(f"{getattr(fn, '__name__', fn)} on {world_size} ranks failed:\n\n" + "\n\n".join(failures))
    return [outcomes[rank][1] for rank in range(world_size)]


# ---- the console script on N ranks, as torchrun starts them ----------------------------------------------------


@dataclass(frozen=True)
class RankExit:
    """One rank of a run_cli job: its exit status as subprocess reports one (the SystemExit code, -N for a signal,
    None where it was killed at the job's timeout), and what it wrote to its stdout and stderr."""

    rank: int
    code: int | None
    stdout: str
    stderr: str


@dataclass(frozen=True)
class CliJob:
    """What run_cli's ranks did: each rank's RankExit, in rank order, and whether the job ran past its timeout."""

    ranks: tuple[RankExit, ...]
    timed_out: bool

    @property
    def codes(self) -> list[int | None]:
        return [rank.code for rank in self.ranks]

    @property
    def stdout(self) -> str:
        """Every rank's stdout, rank 0's first."""
        return "".join(rank.stdout for rank in self.ranks)

    @property
    def stderr(self) -> str:
        """Every rank's stderr, rank 0's first."""
        return "".join(rank.stderr for rank in self.ranks)

    @property
    def output(self) -> str:
        """Every rank's stdout, then every rank's stderr: what a terminal shows of the job, less the interleaving."""
        return self.stdout + self.stderr

    def __str__(self) -> str:  # an assertion's message: each rank's code and the end of its output
        timed_out = " (timed out)" if self.timed_out else ""
        return "\n".join(
            f"rank {r.rank}: exit {r.code}{timed_out}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-3000:]}"
            for r in self.ranks
        )


def run_cli(
    argv: list[str],
    ranks: int = 1,
    *,
    torchrun: bool = True,
    env: dict | None = None,
    timeout_s: float = 240,
    cpus: set[int] | None = None,
    stop_after_failure_s: float = 3,
) -> CliJob:
    """`xdit-lab ARGV` on `ranks` local ranks given torchrun's environment (`torchrun --standalone --nproc_per_node
    RANKS -m xdit_lab.cli ARGV` without the launcher): each rank runs the console script's entry point as its
    `sys.exit(main())`, in this process's environment plus `env`, plus what torchrun's agent sets for its workers
    (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, TORCHELASTIC_RUN_ID and the rest;
    OMP_NUM_THREADS=1 for several ranks where it is not set, as torchrun does). The rendezvous store is served by
    this process, as torchrun's agent serves it (TORCHELASTIC_USE_AGENT_STORE=True), on a port the kernel picks.

    `torchrun=False` (one rank): a plain `xdit-lab ARGV` process in this environment plus `env`, nothing added.
    `cpus` pins every rank to those cores (Linux). The ranks are children of one agent process made for the job,
    as torchrun's are of its agent. When a rank fails, the others get `stop_after_failure_s` to end by themselves,
    then SIGTERM, then SIGKILL (torchrun sends SIGTERM at once); at `timeout_s` every rank still running is killed
    and the job says it timed out. Never raises for what the ranks did: see CliJob."""
    if not torchrun and ranks != 1:
        raise ValueError(f"a plain process is one rank; {ranks} ranks need torchrun=True")
    base = {**os.environ, **(env or {})}
    if torchrun and ranks > 1 and "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = "1"
    store = serve_store(ranks) if torchrun else None  # one job: one store and one run id for all its ranks
    if torchrun:
        run_id = uuid.uuid4().hex
        envs = [{**base, **_torchrun_worker_env(rank, ranks, store.port, run_id)} for rank in range(ranks)]
    else:
        envs = [base]
    folder = tempfile.mkdtemp(prefix="xdit-lab-cli-")
    try:
        agent = _context().Process(
            target=_cli_agent,
            daemon=True,
            name="xdit-lab-cli-agent",
            args=(list(map(str, argv)), envs, folder, timeout_s, stop_after_failure_s, cpus),
        )
        agent.start()
        try:
            agent.join(timeout_s + 2 * stop_after_failure_s + 30)  # the agent keeps the deadline; this, a hung agent
        finally:  # also where this process is interrupted: no rank outlives the call
            if agent.is_alive():
                with contextlib.suppress(OSError):
                    if os.getpgid(agent.pid) == agent.pid:  # the group its ranks are in
                        os.killpg(agent.pid, signal.SIGKILL)
                agent.kill()
                agent.join(5)
        exits = Path(folder, "exits.json")
        if not exits.exists():  # the harness failed, not the ranks
            raise RankFailure(
                f"run_cli's agent for `xdit-lab {' '.join(map(str, argv))}` ended ({agent.exitcode}) "
                "without the ranks' exit codes"
            )
        ended = json.loads(exits.read_text())
        codes = ended["codes"]
        streams = [
            [_read(Path(folder, f"rank{rank}.{stream}")) for stream in ("stdout", "stderr")] for rank in range(ranks)
        ]
        return CliJob(tuple(RankExit(r, codes[r], *streams[r]) for r in range(ranks)), ended["timed_out"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _torchrun_worker_env(rank: int, world_size: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun's agent (torch.distributed.elastic's LocalElasticAgent) sets for worker `rank` of one node."""
    return {
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        **AGENT_STORE,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def console_script(name: str = "xdit-lab"):
    """The function the installed console script `name` runs (pyproject.toml's [project.scripts]): its entry
    point, or, where the package is not installed, the one pyproject.toml names."""
    import importlib
    from importlib.metadata import entry_points

    found = entry_points(group="console_scripts", name=name)
    if found:
        return next(iter(found)).load()
    import tomllib

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    module, _, function = tomllib.loads(pyproject.read_text())["project"]["scripts"][name].partition(":")
    return getattr(importlib.import_module(module), function)


def _cli_agent(argv, envs, folder, timeout_s, stop_after_failure_s, cpus):
    """The job's agent: forks the ranks (their parent, as torchrun's agent is), waits for them, stops the rest
    after a failure or at the deadline, and writes their exit codes to FOLDER/exits.json."""
    os.setpgrp()  # the ranks and whatever they start share this group: what is left is killed with it
    signal.signal(signal.SIGTERM, _stop_the_job)  # multiprocessing ends a daemon so, at its parent's exit
    try:
        _start_and_wait(argv, envs, folder, timeout_s, stop_after_failure_s, cpus)
    finally:
        _kill_the_rest_of_my_group()


def _stop_the_job(signum, frame):
    _kill_the_rest_of_my_group()
    os._exit(128 + signum)


def _start_and_wait(argv, envs, folder, timeout_s, stop_after_failure_s, cpus):
    main = console_script()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    pids = {}
    for rank, env in enumerate(envs):
        pid = os.fork()
        if pid == 0:
            _cli_rank(main, argv, env, Path(folder, f"rank{rank}"), cpus)  # never returns
        pids[pid] = rank
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout_s
    failed_at = terminated_at = None
    timed_out = False
    while len(codes) < len(envs):
        while len(codes) < len(envs):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in pids:
                codes[pids[pid]] = os.waitstatus_to_exitcode(status)
                if codes[pids[pid]] != 0 and failed_at is None:
                    failed_at = time.monotonic()
        running = [pid for pid, rank in pids.items() if rank not in codes]
        now = time.monotonic()
        if running and now > deadline:
            timed_out = True
            _signal(running, signal.SIGKILL)
            for pid in running:
                os.waitpid(pid, 0)
                codes[pids[pid]] = None
        elif running and failed_at is not None and now > failed_at + stop_after_failure_s:
            if terminated_at is None:
                terminated_at = now
                _signal(running, signal.SIGTERM)
            elif now > terminated_at + stop_after_failure_s:
                _signal(running, signal.SIGKILL)
        time.sleep(0.02)
    Path(folder, "exits.json").write_text(
        json.dumps({"codes": [codes[r] for r in range(len(envs))], "timed_out": timed_out})
    )


def _signal(pids, signum) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _kill_the_rest_of_my_group() -> None:
    """Processes the ranks started and left running (a compile worker pool): killed, as their rank has ended."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == me:  # field 5: the process group
                    os.kill(int(entry.name), signal.SIGKILL)


def _cli_rank(main, argv, env, stem: Path, cpus) -> None:
    """One rank: `sys.exit(main())` with ARGV in ENV, its stdout and stderr into STEM.stdout and STEM.stderr; exits
    the process with the status the interpreter would have."""
    status = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the agent's: a rank ends on SIGTERM as torchrun's do
        os.environ.clear()
        os.environ.update(env)
        for fd, suffix in ((1, ".stdout"), (2, ".stderr")):
            file = os.open(f"{stem}{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(file, fd)
            os.close(file)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        sys.argv = [sys.modules[main.__module__].__file__, *argv]  # as `python -m xdit_lab.cli ARGV` has it
        status = _exit_status(main)
    finally:
        # what multiprocessing's own children run on their way out (no atexit: the handlers this fork inherited
        # are the fork server's): the finalizers of what the rank made, its semaphores released (a progress bar's)
        with contextlib.suppress(BaseException):
            from multiprocessing.util import _exit_function

            _exit_function()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(status)


def _exit_status(main) -> int:
    """`sys.exit(main())`'s exit status, as the interpreter makes it: SystemExit's code (None: 0, a number: itself,
    anything else printed to stderr: 1); an uncaught exception's traceback on stderr: 1."""
    try:
        sys.exit(main())
    except SystemExit as exiting:
        code = exiting.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


# ---- a process's peak resident set (Linux /proc), for the tests that bound a load's memory ----------------------


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak() -> tuple[int, int]:
    """Reset VmHWM to the current resident set (writing 5 to /proc/self/clear_refs); (the peak before,
    the peak after), in KiB above the resident set: a caller checks the reset worked."""
    before = status_kib("VmHWM") - status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return before, status_kib("VmHWM") - status_kib("VmRSS")
