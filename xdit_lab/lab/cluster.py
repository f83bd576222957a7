"""Lab: one ipyparallel engine per rank, driven from notebook cells.

    from xdit_lab import ParallelConfig
    from xdit_lab.lab import Lab

    with Lab(n=2) as lab:                        # 2 CPU engines; Lab() = one engine per visible GPU
        lab                                      # the rank table: rank, engine, host, device, pid
        lab.load("path/to/pixart", ParallelConfig(cfg=2))
        session = lab.session("a red cat", seed=0, num_inference_steps=20)
        session.step()                           # exactly one scheduler step, on every engine
        image = session.run().result().images[0]
        lab.configure(ParallelConfig(ulysses=2)) # another strategy on the same engines

Every call runs the same `load_pipeline` and `DenoiseSession` code as `xdit-lab run` on each
engine (see engine.py), in one non-blocking apply to all engines followed by a wait with a
finite timeout: a rank that waits in a collective for a rank that has not been called yet
would hang. Failures come back as one `LabError` naming the rank, the engine and the remote
error text; `lab.restart()` replaces the engines and reloads the last pipeline.

One call at a time reaches the engines (CallLock): two threads (a widget's callback, a cell, a
background job) that applied to the engines at once could have rank 0 run call A then B and rank 1
run B then A, each waiting in the other's collective. A second call waits while the first runs,
within its own timeout_s (which bounds the wait and the call together), and is then refused with a
LabError naming the call that holds the engines. `lab.restart()` holds them for the whole restart.

Ranks are assigned here, not taken from ipyparallel: engine ids are registration order and
survive nothing (a restart gives new ids), so the engines are sorted by id, numbered 0..n-1,
and the mapping is kept (`lab.ranks`). The rank-0 engine's host is the master address.

Engines on several hosts come from ipyparallel's own launchers; start the cluster there and
connect (every host needs this package installed and the model folder at the same path):

    ipcluster start -n 16 --engines=MPI --ip=0.0.0.0 --cluster-id=dit     # or --engines=Slurm
    lab = Lab(connect=True, cluster_id="dit")

    cluster = ipyparallel.Cluster(engine_launcher_class="ssh", controller_ip="0.0.0.0",
                                  cluster_id="dit", config=config)  # c.SSHEngineSetLauncher.engines =
    cluster.start_cluster_sync()                                    #   {"node1": 8, "node2": 8}
    lab = Lab(16, cluster=cluster)  # lab.restart() restarts them with the cluster's launchers (README: Several hosts)

The master address is the rank-0 engine's address on its route to the controller (the rank table's `master`);
pass `master_addr=` to choose another. Each engine's collectives bind the interface its route to the master
leaves by (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: init_distributed), unless its environment sets one.
`lab.stop()` leaves a connected cluster running (it only leaves the process group);
`ipcluster stop --cluster-id=dit` ends it. On GPUs each engine takes the GPU of its local rank
(engines sorted by id on each host), as under torchrun.

How many engine processes start, and that a Lab never stopped still ends with the process that
made it: processes.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import ipyparallel as ipp

from ..distributed import usable_cpu_cores
from ..model_folder import transformer_heads
from . import engine
from .errors import LabError, describe_failures
from .forkserver import FORK_SERVERS, ForkedEngineSetLauncher
from .labsession import LabSession
from .processes import Watchdog, cpu_engines, engine_plan, forget_at_exit, stop_at_exit
from .table import html_table, text_table

GRACE_S = 5.0  # after one rank fails, how long its peers get to fail too before we report


@dataclass(frozen=True)
class Loaded:
    """What `lab.load` was last called with: `configure` and `restart` load it again."""

    name_or_path: str
    config: object  # a ParallelConfig
    options: object  # a LoadOptions


@dataclass(frozen=True)
class PendingCall:
    """A call to one engine that outlived its wait (a timeout, or the notebook's stop button)."""

    row: dict  # the rank table's row of the engine
    result: object  # ipyparallel's AsyncResult
    what: str  # e.g. "lab.session.run"
    started: float  # time.monotonic() when it was sent


@dataclass(frozen=True)
class Holder:
    """The call that has the engines: what it is, the thread it came from, when it began (time.monotonic())."""

    what: str
    thread: str
    started: float


class CallLock:
    """The engines, one call at a time (see the module's docstring). Reentrant: a call made while holding
    it (lab.restart() reloading the pipeline, lab.stop() leaving the process group) goes through."""

    def __init__(self):
        self._lock = threading.RLock()
        self.holder: Holder | None = None  # the outermost call of the thread that holds the lock

    @contextlib.contextmanager
    def held(self, what: str, timeout_s: float):
        """Hold the engines for lab.{what}, waiting at most timeout_s for the call that has them; yields the
        seconds waited."""
        started = time.monotonic()
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            holder = self.holder
            running = (
                f"lab.{holder.what} (called from thread {holder.thread!r} "
                f"{time.monotonic() - holder.started:.0f} s ago)"
                if holder is not None
                else "another call"
            )
            raise LabError(
                f"lab.{what}: {running} still has the engines after {timeout_s:g} s. One call at a time reaches "
                f"the engines, so that every rank runs the same calls in the same order: wait for that call to "
                f"end, or give this one a longer timeout_s"
            )
        outermost = self.holder is None
        if outermost:
            self.holder = Holder(what, threading.current_thread().name, started)
        try:
            yield time.monotonic() - started
        finally:
            if outermost:
                self.holder = None
            self._lock.release()


class Lab:
    """n engines started here (default: one per visible GPU, else one per CPU core; CPU engines run
    one torch thread each), listening on `ip`; or, with connect=True or a cluster_id, the engines of
    a running cluster (`cluster=`: the ipyparallel.Cluster that started them, which lab.restart() restarts with
    its own launchers and their settings). `timeout_s` bounds every call to the engines (methods take their own
    timeout_s too); `collective_timeout_s` is torch.distributed's timeout on the engines.
    `engine_env` adds environment variables to started engines. CPU engines started here are forks of one process
    that imported the libraries once, kept for this process's later Labs (forkserver.py; `fork_engines=False`:
    fresh interpreters, as ipyparallel starts them)."""

    def __init__(
        self,
        n: int | None = None,
        *,
        cluster_id: str | None = None,
        profile: str | None = None,
        connect: bool = False,
        timeout_s: float = 120,
        collective_timeout_s: float = 300,
        ip: str = "127.0.0.1",
        engine_env: dict | None = None,
        backend: str | None = None,
        master_addr: str | None = None,
        cluster: ipp.Cluster | None = None,
        fork_engines: bool | None = None,
    ):
        self.timeout_s, self.collective_timeout_s = timeout_s, collective_timeout_s
        self.profile, self.cluster_id, self.backend, self.master_addr = profile, cluster_id, backend, master_addr
        self.cluster, self.client = None, None
        self.started_by_caller = cluster  # a cluster started by the caller, restarted with its own launchers
        self.owns_cluster = not (connect or cluster_id is not None or cluster is not None)
        self.ranks: list[dict] = []  # one row per rank: engine, host, local_rank, device, pid
        self.loaded: Loaded | None = None  # the last load, for configure and restart
        self.session_token = 0  # bumped by every new session, load and restart
        self._pending: list[PendingCall] = []  # calls that timed out and may still be running
        self._stopped = False
        self._watchdog = None  # the process that stops our cluster if this one is killed
        self.calls = CallLock()  # one call at a time on the engines
        self.n = n  # engines to use (None when connecting: all that are there)
        self.fork_engines = fork_engines  # None: decided when the cluster starts (_start_cluster)
        try:
            if self.owns_cluster:
                self._start_cluster(n, ip, engine_env)
            elif cluster is not None:
                self.cluster_id = cluster.cluster_id
                self.client = cluster.connect_client_sync()
            else:
                self.client = ipp.Client(profile=profile, cluster_id=cluster_id, timeout=timeout_s)
            stop_at_exit(self)
            self._setup(self._wait_for_engines(self.n, exclude=()))
        except BaseException:
            self.stop()  # never leave engines behind a failed start
            raise

    # ---- starting, stopping, restarting ---------------------------------------------------------
    def _start_cluster(self, n, ip, engine_env):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        n, self._engine_env = engine_plan(n, gpus, self.backend, usable_cpu_cores(), engine_env)
        options = {"profile": self.profile} if self.profile else {}  # else ipyparallel's default profile
        if self.fork_engines is None:  # CPU engines on Linux; a GPU engine is never a fork (CUDA)
            self.fork_engines = cpu_engines(gpus, self.backend) and sys.platform == "linux"
        elif self.fork_engines and not cpu_engines(gpus, self.backend):
            raise LabError("fork_engines=True is for CPU engines (a GPU engine cannot be a fork): use backend='gloo'")
        if self.fork_engines:  # its imports run while the controller starts
            FORK_SERVERS.get(self._engine_env)
            options["engine_launcher_class"] = ForkedEngineSetLauncher
        # The hub pings the engines every 0.1 s, not ipyparallel's 3 s: the hub completes an engine's registration on
        # the beat after its first answer, so a Lab waited up to 6 s more for each start (1 s at a 0.5 s period).
        # Still 30 s of missed pings before an engine is declared dead.
        beats = ["--HeartMonitor.period=100", "--HeartMonitor.max_heartmonitor_misses=300"]
        self.cluster = ipp.Cluster(n=n, controller_ip=ip, log_level=30, controller_args=beats, **options)
        self.cluster_id = self.cluster.cluster_id
        self.cluster.start_controller_sync()
        log = os.path.join(self.cluster.profile_dir, "log", f"xdit-lab-watchdog-{self.cluster_id}.log")
        self._watchdog = Watchdog(self.cluster.cluster_file, log)
        self._watchdog.watch([self.cluster.controller.process.pid])
        self.cluster.start_engines_sync(n, environment=self._engine_env)
        self.client = self.cluster.connect_client_sync()
        self.n = n

    def _wait_for_engines(self, n, exclude) -> list[int]:
        """Engine ids to use: n of them not in `exclude` (n None: all registered, at least one)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            ids = sorted(set(self.client.ids) - set(exclude))
            if (len(ids) >= n) if n else ids:
                return ids[:n] if n else ids
            if time.monotonic() > deadline:
                raise LabError(
                    f"only {len(ids)} of {n or 'any'} engines registered within {self.timeout_s:g} s "
                    f"(cluster {self.cluster_id!r}); check the engines' logs in the profile's log folder"
                )
            time.sleep(0.05)

    def _setup(self, engine_ids: list[int]) -> None:
        """Ranks by sorted engine id, local ranks per host, then torch.distributed on all engines at once."""
        self.ranks = [dict(engine=eid) for eid in engine_ids]
        who = self._wait([(eid, self.client[eid].apply_async(engine.describe)) for eid in engine_ids], "describe")
        for rank, row in enumerate(self.ranks):
            row.update(rank=rank, **who[row["engine"]])
            same_host = [r for r in self.ranks[:rank] if r["host"] == row["host"]]
            row["local_rank"] = len(same_host)
        for row in self.ranks:
            row["local_world_size"] = sum(r["host"] == row["host"] for r in self.ranks)
        pushes = []
        for row in self.ranks:  # each engine's own entry of the table, as the state dict in its namespace
            entry = dict(
                rank=row["rank"],
                world_size=self.world_size,
                local_rank=row["local_rank"],
                local_world_size=row["local_world_size"],
            )
            pushes.append((row["engine"], self.client[row["engine"]].push({engine.STATE_NAME: entry}, block=False)))
        self._wait(pushes, "push ranks")
        single_host = len({row["host"] for row in self.ranks}) == 1
        # several hosts: the rank-0 engine's address on its route to the controller, which every engine reaches
        # (its host name may resolve to nothing elsewhere), else that host name
        master = self.master_addr or ("127.0.0.1" if single_host else self.ranks[0]["address"] or self.ranks[0]["host"])
        # The rank-0 engine serves the store (on every interface, a port the kernel picks), the others join it
        port = self.call(engine.serve_store, ranks=[0], what="serve the rendezvous store")[0]
        joined = self.call(engine.init, master, port, self.collective_timeout_s, self.backend, what="init_distributed")
        for row in self.ranks:
            row.update(joined[row["rank"]], master=f"{master}:{port}")
        if self.owns_cluster:  # the controller again: by now it has started its schedulers
            self._watchdog.watch([self.cluster.controller.process.pid, *(row["pid"] for row in self.ranks)])

    def stop(self) -> None:
        """Leave the process group on every engine; stop the cluster if this Lab started it."""
        if self._stopped:
            return
        self._stopped = True
        forget_at_exit(self)
        try:
            if self.client is not None and self.ranks:  # (call refuses at once if an engine is gone or busy)
                self.call(engine.shutdown, timeout_s=min(30, self.timeout_s), what="stop")
        except LabError:
            pass  # engines that are gone or stuck are stopped below anyway
        finally:
            if self.client is not None:
                self.client.close()
            if self.owns_cluster and self.cluster is not None:
                # Stopped engines exit with code 1, which ipyparallel reports as a warning with each
                # engine's whole log. Expected here: quiet this cluster's own logger (not a shared one).
                if self.cluster.log.name.endswith(str(self.cluster_id)):
                    self.cluster.log.setLevel(logging.ERROR)
                self._end_engines_now()
                self.cluster.stop_cluster_sync()
            if self._watchdog is not None:  # after the cluster: it ends what the stop left running
                self._watchdog.close()

    def _end_engines_now(self) -> None:
        """End the engines this Lab started, at once: they have left their process group (stop) or are being
        replaced (restart), and hold nothing to save. ipyparallel's own stop (SIGTERM, up to 5 s, then SIGKILL)
        took 1.4 s for two idle engines, and waits its 5 s for a hung one; it then finds them gone."""
        try:
            self.cluster.signal_engines_sync(signal.SIGKILL)
        except Exception:  # noqa: BLE001 - gone already; the stop that follows ends whatever is left
            pass

    def restart(self) -> Lab:
        """Stop the engines, start fresh ones, join them again and reload the last pipeline."""
        if self._stopped:
            raise LabError("this Lab is stopped: make a new one")
        with self.calls.held("restart", self.timeout_s):
            return self._restart()

    def _restart(self) -> Lab:
        old = [row["engine"] for row in self.ranks] + list(self.client.ids)
        self._pending.clear()
        self.session_token += 1  # sessions of the old engines are gone with them
        if self.owns_cluster:
            self._end_engines_now()
            self.cluster.stop_engines_sync()
            self.cluster.start_engines_sync(self.n, environment=self._engine_env)
        elif self.started_by_caller is not None:  # its launchers as the caller configured them (SSH: its keys)
            self.started_by_caller.restart_engines_sync()
        else:
            try:
                cluster = ipp.Cluster.from_file(profile=self.profile, cluster_id=self.cluster_id or "")
                cluster.restart_engines_sync()
            except Exception as error:
                raise LabError(
                    f"cannot restart the engines of cluster {self.cluster_id!r}, which this Lab did not "
                    f"start ({type(error).__name__}: {error}); restart them where they were started "
                    f"(ipcluster) and connect a new Lab, or make the Lab with cluster=your ipyparallel.Cluster"
                ) from None
        self._setup(self._wait_for_engines(self.n or len(self.ranks), exclude=old))
        if self.loaded is not None:
            self.load(self.loaded.name_or_path, self.loaded.config, self.loaded.options)
        return self

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- pipelines and sessions -------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def load(self, name_or_path, config, options=None, *, timeout_s: float | None = None, **keywords) -> Lab:
        """load_pipeline(name_or_path, config, options, **keywords) on every engine (idle ones under a smaller
        config): `options` a LoadOptions, each of its fields a keyword too (a mistyped one is refused here)."""
        from ..load_options import LoadOptions

        options = LoadOptions.given(options, **keywords)
        if config.world_size > self.world_size:  # raises, listing what fits the engines and the model's heads
            config.validate(self.world_size, num_heads=transformer_heads(name_or_path))
        config.validate(config.world_size)
        self.session_token += 1
        for row in self.ranks:
            row["role"] = ""  # the engines drop their pipeline first: until this load succeeds, none
        roles = self.call(engine.load, str(name_or_path), config, options, timeout_s=timeout_s, what="load")
        for row in self.ranks:  # the table shows where each rank sits in the new grid
            coords = roles[row["rank"]]["coords"]
            used = [f"{name}={value}" for name, value in (coords or {}).items() if getattr(config, name) > 1]
            row["role"] = ("·".join(used) or "serial") if coords else "idle"
        self.loaded = Loaded(str(name_or_path), config, options)
        return self

    def configure(self, config, *, timeout_s: float | None = None) -> Lab:
        """Another ParallelConfig on the same engines: a new mesh, the last pipeline loaded again."""
        if self.loaded is None:
            raise LabError("nothing is loaded yet: call lab.load(name_or_path, config) first")
        return self.load(self.loaded.name_or_path, config, self.loaded.options, timeout_s=timeout_s)

    @property
    def config(self):
        return None if self.loaded is None else self.loaded.config

    def session(self, prompt, *args, timeout_s: float | None = None, **kwargs) -> LabSession:
        """pipe.session(prompt, ...) on every active engine; step it, run it, fetch the result."""
        if self.loaded is None:
            raise LabError("nothing is loaded yet: call lab.load(name_or_path, config) first")
        self.session_token += 1
        progress = self.call(engine.start_session, (prompt, *args), kwargs, timeout_s=timeout_s, what="session")[0]
        return LabSession(self, self.session_token, progress)

    def generate(self, prompts, output, **kwargs) -> dict:
        """Draw every image of a prompts file (or a list of prompts) into `output`, batch by batch, each image
        written and recorded as it is made; a rerun resumes (generation.generate, `xdit-lab run --prompts`)."""
        from .generation import generate

        return generate(self, prompts, output, **kwargs)

    def explorer(self, **kwargs):
        """The ipywidgets panel over this Lab (explorer_widgets.Explorer; kwargs go to its controller)."""
        from .explorer_widgets import Explorer  # here: ipywidgets is only needed for the panel

        return Explorer(self, **kwargs)

    # ---- calling the engines ------------------------------------------------------------------------
    def call(
        self, fn, *args, ranks=None, state: bool = True, timeout_s: float | None = None, what: str | None = None
    ) -> dict:
        """fn(engine_state, *args) on the engines of `ranks` (default: all) in one non-blocking apply;
        returns {rank: result}. Raises LabError on a remote error, a dead engine or the timeout, which
        bounds the wait for a call from another thread that has the engines (CallLock) and this call together."""
        what = what or fn.__name__
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self.calls.held(what, timeout) as waited:
            self._check_usable(what)
            ranks = list(range(self.world_size)) if ranks is None else list(ranks)
            targets = [self.ranks[r]["engine"] for r in ranks]
            head = (ipp.Reference(engine.STATE_NAME),) if state else ()
            # split() gives one AsyncResult per engine; a one-engine list view would answer [result]
            view = self.client[targets if len(targets) > 1 else targets[0]]
            parts = view.apply_async(fn, *head, *args).split()
            by_engine = self._wait(list(zip(targets, parts)), what, max(0.0, timeout - waited))
            return {self.ranks[r]["rank"]: by_engine[e] for r, e in zip(ranks, targets)}

    def _check_usable(self, what):
        if self._stopped:
            raise LabError(f"lab.{what}: this Lab is stopped; make a new one")
        gone = [row for row in self.ranks if row["engine"] not in self.client.ids]
        if gone:
            raise LabError(
                describe_failures(
                    what, [dict(row, error="the engine is gone (its process ended or it unregistered)") for row in gone]
                )
            )
        self._pending = [call for call in self._pending if not call.result.done()]
        if self._pending:
            call = self._pending[0]
            raise LabError(
                f"lab.{what}: rank {call.row['rank']} (engine {call.row['engine']}) is still busy with "
                f"{call.what}, started {time.monotonic() - call.started:.0f} s ago; wait for it, or "
                f"lab.restart()"
            )

    def _wait(self, calls: list[tuple[int, object]], what: str, timeout_s=None) -> dict:
        """Wait for every (engine_id, AsyncResult), with a finite timeout; {engine_id: result} or LabError."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        parts = [part for _, part in calls]
        rows = {row["engine"]: row for row in self.ranks}
        try:
            done, pending = concurrent.futures.wait(parts, timeout, concurrent.futures.FIRST_EXCEPTION)
            if pending and any(part.exception() is not None for part in done):
                # One rank failed; its peers may now wait in a collective for it. Let them fail too, briefly.
                remaining = max(0.0, timeout - (time.monotonic() - started))
                concurrent.futures.wait(pending, min(GRACE_S, remaining))
        except BaseException:  # e.g. the notebook's stop button: remember who is still working
            self._pending += [
                PendingCall(rows.get(e, dict(engine=e)), p, f"lab.{what}", started) for e, p in calls if not p.done()
            ]
            raise
        waited = time.monotonic() - started
        failures, results = [], {}
        for eid, part in calls:
            row = rows.get(eid, dict(engine=eid))
            if not part.done():
                failures.append(dict(row, error=f"no answer after {waited:.0f} s"))
                self._pending.append(PendingCall(row, part, f"lab.{what}", started))
            elif part.exception() is not None:
                error = part.exception()
                failures.append(
                    dict(
                        row,
                        error=f"{getattr(error, 'ename', type(error).__name__)}: {getattr(error, 'evalue', error)}",
                        traceback=getattr(error, "traceback", None),
                    )
                )
            else:
                results[eid] = part.result()
        if failures:
            timed_out = any(f["error"].startswith("no answer") for f in failures)
            raise LabError(
                describe_failures(
                    what, failures, collective_timeout_s=(self.collective_timeout_s if timed_out else None)
                ),
                failures,
            )
        return results

    # ---- the rank table --------------------------------------------------------------------------
    COLUMNS = ("rank", "engine", "host", "local_rank", "device", "pid", "role")

    def _rows(self) -> list[list[str]]:
        return [[str(row.get(c, "")) for c in self.COLUMNS] for row in self.ranks]

    def _title(self) -> str:
        backend = self.ranks[0].get("backend", "?") if self.ranks else "?"
        config = f", {self.config.short()}" if self.config else ""
        state = "stopped" if self._stopped else f"{self.world_size} ranks, {backend}{config}"
        return f"Lab (cluster {self.cluster_id!r}, {state})"

    def table(self) -> str:
        """The rank table: which engine (and host, device, process) is which rank, and its role."""
        return text_table(self.COLUMNS, self._rows(), self._title())

    def __repr__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        return html_table(self.COLUMNS, self._rows(), self._title())
