"""A step without host waits, the GPU defaults, and PipeFusion's links (issue 42), checked on CPU.

1. A denoising step reads nothing back to the host. On a GPU every read of a device tensor's value
   (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`, ...) and every `torch.cuda.synchronize` is a sync: the
   host waits for the device to catch up. Here every such call is counted per step, by a TorchFunctionMode
   and by patching torch.cuda.synchronize: 0 per step, 1 with a StepCache (its decision's `.tolist()`),
   and two deliberately wrong variants, run, are counted (main's PhaseTimings, which synchronized around
   every step, and a NaN check in the step). The timeline is recorded only when asked for; the bytes always.
2. `torch_dtype="auto"`: bfloat16 on CUDA, float32 on CPU (load_pipeline, lab.load, `xdit-lab run`).
3. PipeFusion's messages travel on one two-rank communicator per direction between neighbouring stages.
   Each rank's posting order, recorded at torch.distributed's door in real gloo runs of the drained and
   async schedules on 3 and 4 stages, is replayed through a model of NCCL (`replay`): no deadlock and no
   send ever waits behind a receive; the same postings on main's communicators (one per pipefusion group,
   plus the async return one) do show sends waiting, and the async one deadlocks where a communicator
   over every stage must be joined by all of them.

What this cannot see on CPU: syncs inside torch's C++ operators (tests/gpu/test_host_waits.py runs a
step under CUDA's sync debug mode on a GPU)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import time

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from xdit_lab import ParallelConfig, comm
from xdit_lab.digits import DIGITS_DIR, prompt_for
from xdit_lab.mesh import PIPEFUSION
from xdit_lab.models import StepCache
from xdit_lab.pipeline import load_pipeline, resolve_dtype
from xdit_lab.session import PhaseTimings
from xdit_lab.testing import run_on_ranks

Tensor = torch.Tensor

# ---- the instrument: reads of a tensor's value by the host, and device synchronizes --------------------------

HOST_READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.cpu,
    Tensor.numpy,
    Tensor.__bool__,
    Tensor.__int__,
    Tensor.__float__,
    Tensor.__index__,
    Tensor.nonzero,
    torch.nonzero,
    Tensor.equal,
    torch.equal,
    Tensor.masked_select,
    torch.masked_select,
    Tensor.unique,
    torch.unique,
}


def _to_host(args, kwargs) -> bool:
    """`.to("cpu")` by name: a copy to the host. (`.to(x.device)` moves to the compute device, which is the
    CPU here: on CPU the two are told apart only by how the code names the target.)"""
    return any(isinstance(t, str) and t.startswith("cpu") for t in (*args[1:], kwargs.get("device")))


class HostReads(TorchFunctionMode):
    """Every call inside the block that hands a tensor's value to the host (a sync on a GPU), by name, and
    (through `counting_synchronize`) every torch.cuda.synchronize. All tensors are the device's here: on
    CPU, a read is counted as a GPU would pay for it."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS or (func is Tensor.to and _to_host(args, kwargs)):
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_synchronize(reads: list[str]):
    """torch.cuda.synchronize replaced by a counter (there is no device to wait for on CPU)."""
    real = torch.cuda.synchronize

    def synchronize(device=None):
        reads.append("torch.cuda.synchronize")
        if torch.cuda.is_available():
            real(device)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = real


class MainsPhaseTimings(PhaseTimings):
    """A deliberately wrong control: main's PhaseTimings, which synchronized the device before and after
    every phase (on a CUDA device; here it calls the counted torch.cuda.synchronize as it would there)."""

    @contextlib.contextmanager
    def measure(self, phase):
        torch.cuda.synchronize()
        with super().measure(phase):
            yield
        torch.cuda.synchronize()


def _nan_checked(run_step):
    """A deliberately wrong control: a NaN check after the step, as a careful loop might add (one read)."""

    def run(context, t):
        run_step(context, t)
        if context.prepared.latents.isnan().any():
            raise FloatingPointError("NaN in the latents")

    return run


CASES = {
    "ulysses2": (ParallelConfig(ulysses=2), None, None),
    "cfg2": (ParallelConfig(cfg=2), None, None),
    "pf2 drained": (ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1), None, None),
    "pf2 async": (ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1, pipefusion_schedule="async"), None, None),
    "ulysses2 StepCache": (ParallelConfig(ulysses=2), StepCache(0.1), None),
    "pf2 StepCache": (ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1), StepCache(0.1), None),
    "control: main's PhaseTimings": (ParallelConfig(ulysses=2), None, "timings"),
    "control: a NaN check": (ParallelConfig(ulysses=2), None, "nan"),
}
STEPS = 4


def _reads_per_step(output):
    """On this rank, per case: the host reads of each step (names), the steps' seconds, the dtype loaded by
    default, and what the timeline recorded, off (the default) and on; then `xdit-lab run`'s report (rank 0)
    of a run with its defaults."""
    from xdit_lab.load_options import LoadOptions
    from xdit_lab.models import parallel_state
    from xdit_lab.run import run_generation

    out = {}
    for name, (config, cache, control) in CASES.items():
        pipe = load_pipeline(DIGITS_DIR, config, cache=cache, progress=False)
        try:
            session = pipe.session([prompt_for(3), prompt_for(8)], num_inference_steps=STEPS, seed=0)
            strategy = parallel_state(pipe.diffusers_pipeline.transformer).strategy
            if control == "timings":
                session.timings = MainsPhaseTimings(pipe.device)
            if control == "nan":
                strategy.run_step = _nan_checked(strategy.run_step)
            per_step = []
            for _ in range(STEPS):
                with HostReads() as mode, counting_synchronize(mode.reads):
                    session.step()
                per_step.append(mode.reads)
            row = dict(
                reads=per_step,
                seconds=session.timings.as_dict()["steps"],
                dtype=str(pipe.diffusers_pipeline.transformer.dtype),
                spans=session.last_step_spans,
                comm=session.comm_per_step,
            )
            if name == "ulysses2":  # the same request with the timeline on: spans, the same bytes, no reads
                on = pipe.session([prompt_for(3), prompt_for(8)], num_inference_steps=STEPS, seed=0, timeline=True)
                reads = []
                for _ in range(STEPS):
                    with HostReads() as mode, counting_synchronize(mode.reads):
                        on.step()
                    reads.append(mode.reads)
                row.update(timeline_spans=on.last_step_spans, timeline_comm=on.comm_per_step, timeline_reads=reads)
            out[name] = row
        finally:
            pipe.close()
    quiet = LoadOptions(progress=False)
    report = run_generation("digits", [prompt_for(5)], ParallelConfig(cfg=2), output, load_options=quiet, steps=2)
    out["report dtype"] = None if report is None else report["dtype"]
    return out


@pytest.fixture(scope="module")
def reads(tmp_path_factory):
    return run_on_ranks(_reads_per_step, 2, str(tmp_path_factory.mktemp("run")), timeout_s=400)


def test_a_step_reads_nothing_back_to_the_host(reads):
    for rank, cases in enumerate(reads):
        for name in ("ulysses2", "cfg2", "pf2 drained", "pf2 async"):
            assert cases[name]["reads"] == [[]] * STEPS, (rank, name, cases[name]["reads"])
            assert len(cases[name]["seconds"]) == STEPS and all(s > 0 for s in cases[name]["seconds"])


def test_a_step_cache_reads_its_decision_once_per_step(reads):
    for rank, cases in enumerate(reads):
        for name in ("ulysses2 StepCache", "pf2 StepCache"):
            # the first step has nothing to compare with; every later one reads the two agreed sums
            assert cases[name]["reads"] == [[]] + [["tolist"]] * (STEPS - 1), (rank, name, cases[name]["reads"])


def test_the_count_catches_a_step_that_waits(reads):
    """The controls, run: main's PhaseTimings (a synchronize before and after each step) and a NaN check."""
    for cases in reads:
        timings = cases["control: main's PhaseTimings"]["reads"]
        assert timings == [["torch.cuda.synchronize"] * 2] * STEPS, timings
        nan = cases["control: a NaN check"]["reads"]
        assert nan == [["__bool__"]] * STEPS, nan


def test_the_timeline_is_recorded_only_when_asked_and_the_bytes_always(reads):
    for cases in reads:
        off = cases["ulysses2"]
        assert off["spans"] is None
        assert len(off["comm"]) == STEPS and all(step.get("ulysses", 0) > 0 for step in off["comm"])
        assert off["timeline_comm"] == off["comm"]  # the bytes do not depend on the timeline
        spans = off["timeline_spans"]
        assert spans["step"] == STEPS - 1 and any(s["group"] == "ulysses" for s in spans["spans"])
        assert off["timeline_reads"] == [[]] * STEPS  # host clock readings only


def test_cpu_loads_float32_by_default(reads):
    for cases in reads:
        assert {row["dtype"] for name, row in cases.items() if name in CASES} == {"torch.float32"}
    assert [cases["report dtype"] for cases in reads] == ["float32", None]  # what it ran in, named; rank 0 writes


# ---- PhaseTimings: marks now, seconds when asked ------------------------------------------------------------


def test_phase_timings_mark_now_and_read_when_asked():
    timings = PhaseTimings(torch.device("cpu"))
    for pause in (0.02, 0.04):
        with timings.measure("step"):
            time.sleep(pause)
    with timings.measure("decode"):
        pass
    assert all(isinstance(mark, tuple) for mark in timings._marks["step"])  # nothing read yet
    first, second = timings.steps
    assert 0.02 <= first < 0.035 and 0.04 <= second < 0.055, (first, second)
    assert timings.as_dict()["denoise"] == pytest.approx(first + second)
    assert timings.steps == [first, second]  # read once: the same figures again
    with pytest.raises(ValueError, match="unknown phase 'denoise'"):
        with timings.measure("denoise"):
            pass


# ---- GPU defaults ---------------------------------------------------------------------------------------------


def test_auto_dtype_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda", 3)) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("float16", "cuda") is torch.float16  # named: as given, on any device
    assert resolve_dtype(torch.float32, "cuda") is torch.float32
    assert resolve_dtype("torch.bfloat16", "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="'auto' .*bfloat16, float16.*got 'fp8'"):
        resolve_dtype("fp8", "cuda")
    with pytest.raises(ValueError, match="got torch.int8"):
        resolve_dtype(torch.int8, "cpu")


def test_load_pipeline_and_xdit_lab_run_default_to_auto():
    import inspect

    from xdit_lab.cli import _build_parser
    from xdit_lab.load_options import LoadOptions
    from xdit_lab.run import run_generation

    assert LoadOptions().torch_dtype == "auto"  # what load_pipeline and run_generation load with, given none
    assert inspect.signature(load_pipeline).parameters["options"].default is None
    assert inspect.signature(run_generation).parameters["load_options"].default is None
    args = _build_parser().parse_args(["run", "--model", "digits", "--prompt", "a 3", "--output", "out"])
    assert args.dtype == "auto"


# ---- a model of NCCL, replayed ----------------------------------------------------------------------------------


class _Op:
    def __init__(self, rank, comm_name, kind, peer, batch, index):
        self.rank, self.comm, self.kind, self.peer, self.batch, self.index = rank, comm_name, kind, peer, batch, index
        self.launched = self.done = False
        self.match, self.group = None, None

    def __repr__(self):
        return f"{self.kind}(rank {self.rank}, peer {self.peer}, {self.comm})"


def replay(
    programs: dict[int, list], members: dict[str, list[int]], *, lazy_init: bool = False, slow: dict | None = None
) -> dict:
    """Run each rank's program (its postings, waits, collectives and computes, in its order) on a model of
    GPUs and NCCL. A rank's device runs the program in order: a compute takes one time unit (`slow`: rank ->
    units, for a rank whose computes take longer); a posting
    launches its operations on their communicators (an operation posted after a wait starts after what was
    waited for: the stream waits there); a wait holds the device until its operations are done; a
    collective is a posting and a wait. Each communicator runs one rank's operations in the order posted
    (those of one batch together): an operation starts only when everything posted before it on that
    communicator by that rank is done. The k-th send from a to b on a communicator completes with the
    k-th receive at b from a on it, when both have started; a collective, when every member's has.
    `lazy_init`: a communicator works only once every member has posted on it (NCCL initialises a
    communicator with all its ranks together; torch does so at the first batched point-to-point on a group).

    Returns finished (bool), stuck (rank: the action it is stuck at), time (units), and send_waits: per
    time unit, the sends that could go (the receiver is ready) but wait behind a receive posted earlier on
    their own communicator."""
    queues: dict = collections.defaultdict(list)
    pairs: dict = collections.defaultdict(lambda: ([], []))
    collectives: dict = collections.defaultdict(list)
    actions: dict[int, list] = {}
    ops: list[_Op] = []
    batches = itertools.count()

    def new_op(rank, comm_name, kind, peer, batch):
        op = _Op(rank, comm_name, kind, peer, batch, len(queues[rank, comm_name]))
        queues[rank, comm_name].append(op)
        ops.append(op)
        return op

    for rank, program in programs.items():
        by_id, mine = {}, []
        for event in program:
            if event[0] == "post":
                batch, posted = next(batches), []
                for op_id, kind, peer, comm_name in event[1]:
                    op = by_id[op_id] = new_op(rank, comm_name, kind, peer, batch)
                    pair = pairs[(rank, peer, comm_name) if kind == "send" else (peer, rank, comm_name)]
                    pair[0 if kind == "send" else 1].append(op)
                    posted.append(op)
                mine.append(("post", posted))
            elif event[0] == "wait":
                mine.append(("wait", [by_id[event[1]]]))
            elif event[0] == "collective":
                op = new_op(rank, event[1], "collective", None, next(batches))
                collectives[rank, event[1]].append(op)
                mine += [("post", [op]), ("wait", [op])]
            else:
                mine.append(("compute", []))
        actions[rank] = mine
    for sends, recvs in pairs.values():
        for send, recv in zip(sends, recvs):
            send.match, recv.match = recv, send
    for (_rank, comm_name), posted in collectives.items():
        for k, op in enumerate(posted):
            peers = [collectives[m, comm_name] for m in members[comm_name]]
            op.group = [p[k] if k < len(p) else None for p in peers]

    joined = collections.defaultdict(set)

    def started(op) -> bool:
        if not op.launched or op.done:
            return False
        if lazy_init and not joined[op.comm] >= set(members[op.comm]):
            return False
        return all(prev.done or prev.batch == op.batch for prev in queues[op.rank, op.comm][: op.index])

    pc, busy_until, t, send_waits = dict.fromkeys(actions, 0), dict.fromkeys(actions, 0), 0, []
    while True:
        moved = True
        while moved:
            moved = False
            for rank, mine in actions.items():
                while pc[rank] < len(mine) and busy_until[rank] <= t:
                    kind, posted = mine[pc[rank]]
                    if kind == "compute":
                        busy_until[rank], pc[rank], moved = t + (slow or {}).get(rank, 1), pc[rank] + 1, True
                    elif kind == "post":
                        for op in posted:
                            op.launched = True
                            joined[op.comm].add(rank)
                        pc[rank], moved = pc[rank] + 1, True
                    elif all(op.done for op in posted):
                        pc[rank], moved = pc[rank] + 1, True
                    else:
                        break
            for op in ops:
                if op.kind == "send" and op.match is not None and started(op) and started(op.match):
                    op.done = op.match.done = moved = True
                elif op.kind == "collective" and op.group and all(o is not None and started(o) for o in op.group):
                    for o in op.group:
                        o.done = True
                    moved = True
        waiting = [
            op
            for op in ops
            if op.kind == "send"
            and op.launched
            and not op.done
            and op.match is not None
            and started(op.match)
            and not started(op)
            and any(not prev.done and prev.kind == "recv" for prev in queues[op.rank, op.comm][: op.index])
        ]
        send_waits.append(waiting)
        if all(pc[rank] == len(mine) for rank, mine in actions.items()):
            return dict(finished=True, stuck={}, time=t, send_waits=sum(map(len, send_waits)))
        if all(busy_until[rank] <= t for rank in actions):  # nothing computes, nothing can move: stuck for good
            stuck = {rank: mine[pc[rank]] for rank, mine in actions.items() if pc[rank] < len(mine)}
            return dict(finished=False, stuck=stuck, time=t, send_waits=sum(map(len, send_waits)))
        t += 1


def test_the_model_deadlocks_receives_posted_before_sends_on_one_communicator():
    """Its own check, by hand: two ranks that each receive, then send, deadlock on one communicator (the
    classic NCCL hang) and finish on one communicator per direction; a communicator over three ranks that
    only two use never starts when it must be joined by all."""

    def swap(comm_in, comm_out, peer):
        return [("post", [(0, "recv", peer, comm_in)]), ("post", [(1, "send", peer, comm_out)]), ("wait", 0)]

    one = {0: swap("c", "c", 1), 1: swap("c", "c", 0)}
    assert not replay(one, {"c": [0, 1]})["finished"]
    links = {0: swap("1>0", "0>1", 1), 1: swap("0>1", "1>0", 0)}
    assert replay(links, {"0>1": [0, 1], "1>0": [0, 1]})["finished"]
    pair = {0: [("post", [(0, "send", 1, "c3")]), ("wait", 0)], 1: [("post", [(0, "recv", 0, "c3")]), ("wait", 0)]}
    pair[2] = [("compute",)]
    assert replay(pair, {"c3": [0, 1, 2]})["finished"]
    assert not replay(pair, {"c3": [0, 1, 2]}, lazy_init=True)["finished"]


# ---- PipeFusion's postings, recorded from real runs ---------------------------------------------------------------


@contextlib.contextmanager
def _recorded_postings():
    """What this rank hands torch.distributed, in order: each batch_isend_irecv's operations (kind, peer,
    communicator), each wait on them, each collective; and each PipeFusion patch computed (comm.computing)."""
    program, ids = [], itertools.count()
    real = {name: getattr(dist, name) for name in ("batch_isend_irecv", "broadcast", "all_gather", "all_reduce")}
    real_computing = comm.computing

    class Waited:
        def __init__(self, work, op_id):
            self.work, self.op_id = work, op_id

        def wait(self, *args):
            program.append(("wait", self.op_id))
            return self.work.wait(*args)

    def batch_isend_irecv(ops):
        numbered = [next(ids) for _ in ops]
        described = [
            (i, "send" if op.op is dist.isend else "recv", op.peer, op.group.group_name) for i, op in zip(numbered, ops)
        ]
        program.append(("post", described))
        works = real["batch_isend_irecv"](ops)
        assert len(works) == len(ops)  # gloo: one request per operation
        return [Waited(work, i) for work, i in zip(works, numbered)]

    def collective(name):
        def call(*args, group=None, **kwargs):
            program.append(("collective", (group or dist.group.WORLD).group_name))
            return real[name](*args, group=group, **kwargs)

        return call

    def computing(group, tag):
        program.append(("compute",))
        return real_computing(group, tag)

    dist.batch_isend_irecv = batch_isend_irecv
    for name in ("broadcast", "all_gather", "all_reduce"):
        setattr(dist, name, collective(name))
    comm.computing = computing
    try:
        yield program
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        comm.computing = real_computing


def _posting_orders(stages: int):
    """On this rank of `stages`: the drained and the async sessions' postings (4 patches, warmup 1, 4 steps),
    the communicators they name (members; a link's direction; the pipefusion group), and the process groups
    before the load, with the mesh built, and after closing it."""
    from torch.distributed.distributed_c10d import _world

    out = {}
    for schedule in ("drained", "async"):
        config = ParallelConfig(pipefusion=stages, num_patches=4, warmup_steps=1, pipefusion_schedule=schedule)
        before = len(_world.pg_map)
        pipe = load_pipeline(DIGITS_DIR, config, progress=False)
        mesh = pipe.mesh
        session = pipe.session([prompt_for(3)], num_inference_steps=4, seed=0)
        with _recorded_postings() as program:
            session.run()
        comms = {mesh.group(PIPEFUSION).group_name: dict(members=mesh.group_ranks(PIPEFUSION), link=None)}
        for src, dst in mesh.all_links():
            if mesh.rank in (src, dst):
                comms[mesh.link(src, dst).group_name] = dict(members=sorted((src, dst)), link=(src, dst))
        built = len(_world.pg_map)
        pipe.close()
        try:
            mesh.link(*next((s, d) for s, d in mesh.all_links() if mesh.rank in (s, d)))
            used = None
        except RuntimeError as error:
            used = str(error)
        out[schedule] = dict(
            program=program,
            comms=comms,
            links=mesh.all_links(),
            stages=mesh.group_ranks(PIPEFUSION),
            groups=(before, built, len(_world.pg_map)),
            used_after_close=used,
        )
    return out


@pytest.fixture(scope="module")
def postings():
    return {stages: run_on_ranks(_posting_orders, stages, stages, timeout_s=300) for stages in (3, 4)}


def _as_on_main(programs: dict, comms: dict, stages: list[int]) -> tuple[dict, dict]:
    """The same postings on main's communicators: every PipeFusion message on the pipefusion group's one
    communicator, except the async schedule's latents from the last stage to stage 0, on a second
    communicator over the whole pipefusion group (mesh.group(PIPEFUSION, returning=True) on main)."""
    (pipefusion,) = [name for name, c in comms.items() if c["link"] is None]
    back = (stages[-1], stages[0])
    rename = {
        name: ("return" if c["link"] == back else pipefusion) for name, c in comms.items() if c["link"] is not None
    }
    members = {pipefusion: stages, "return": stages}
    old = {
        rank: [
            ("post", [(i, kind, peer, rename.get(name, name)) for i, kind, peer, name in event[1]])
            if event[0] == "post"
            else event
            for event in program
        ]
        for rank, program in programs.items()
    }
    return old, members


@pytest.mark.parametrize("schedule", ["drained", "async"])
@pytest.mark.parametrize("stages", [3, 4])
def test_pipefusion_links_never_queue_a_send_behind_a_receive(postings, stages, schedule):
    per_rank = [rank[schedule] for rank in postings[stages]]
    programs = {rank: out["program"] for rank, out in enumerate(per_rank)}
    comms = {name: c for out in per_rank for name, c in out["comms"].items()}
    members = {name: c["members"] for name, c in comms.items()}
    ranks = per_rank[0]["stages"]
    wrap = [(ranks[-1], ranks[0])] if schedule == "async" else []
    assert per_rank[0]["links"] == [*zip(ranks, ranks[1:]), *wrap]
    # each rank sends on its outgoing link only and receives on its incoming one only
    for rank, program in programs.items():
        for event in (e for e in program if e[0] == "post"):
            for _, kind, peer, name in event[1]:
                assert comms[name]["link"] == ((rank, peer) if kind == "send" else (peer, rank)), (rank, event)
    # every stage as fast as the others, and each stage in turn three times slower than the rest
    timings = [None, *({rank: 3} for rank in ranks)]
    old, old_members = _as_on_main(programs, comms, ranks)
    waits_on_main = []
    for slow in timings:
        for lazy_init in (False, True):
            result = replay(programs, members, lazy_init=lazy_init, slow=slow)
            assert result["finished"], (slow, lazy_init, result["stuck"])
            assert result["send_waits"] == 0, (slow, lazy_init, result)
        # the control: the same postings on main's communicators
        on_main = replay(old, old_members, slow=slow)
        assert on_main["finished"], (slow, on_main["stuck"])
        waits_on_main.append(on_main["send_waits"])
    if schedule == "drained":  # a middle stage's send of patch i waited behind its receive of patch i+1
        assert max(waits_on_main) > 0, waits_on_main
    else:  # one patch per call, received then sent: no wait; but the middle stages never post on the return
        # communicator, which must be joined by every member to start: stage 0 waits for its latents for ever
        stuck = replay(old, old_members, lazy_init=True)
        assert not stuck["finished"], stuck
        assert {kind for kind, _ in stuck["stuck"].values()} == {"wait"}, stuck


def test_links_are_made_with_the_mesh_and_closed_with_it(postings):
    for stages, per_rank in postings.items():
        for rank in per_rank:
            for schedule, out in rank.items():
                before, built, after = out["groups"]
                assert built > before and after == before, (stages, schedule, out["groups"])
                assert out["used_after_close"] and "was closed" in out["used_after_close"]
