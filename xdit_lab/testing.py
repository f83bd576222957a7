"""run_on_ranks: run a function on N real processes over gloo, from pytest or a script.

    results = run_on_ranks(check_all_reduce, 4, ParallelConfig(ulysses=2, ring=2))

Each child joins a fresh process group on a free localhost port, calls
`fn(*args, **kwargs)` and sends back its return value (anything picklable; tensors are fine).
The parent waits at most `timeout_s`; a child that raises has its traceback re-raised in the
parent as `RankFailure`, and a child that hangs or dies is killed and reported the same way.

Children come from a forkserver that has already imported torch and diffusers, so a 4-rank
test pays the ~3 s import once, not once per rank and per test. Where CUDA is visible they are
spawned instead: importing diffusers asks CUDA for its devices, and torch then refuses CUDA in
every process forked after that ("Cannot re-initialize CUDA in forked subprocess").
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import re
import time
import traceback

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
    from xdit_lab.distributed import free_port

    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    collective_timeout_s = collective_timeout_s or max(5.0, timeout_s * 0.8)
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
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
