"""Every collective of the package, counted.

All communication goes through these functions, each naming the mesh group it runs on
("ulysses", "ring", "sp", "pipefusion", "cfg", "dp"). Each call appends a `CommRecord` to the
logs opened with `comm_log()`, so notebook views and benchmarks read what really moved:

    with xdit_lab.comm_log() as log:
        ...
    log.bytes_by_group()   # {"ulysses": 49152, ...}

`bytes` is the size of the tensor handed to the call on this rank; `bytes_out` is what must
leave this rank for the call to complete, in the direct model: an all-to-all keeps its own
1/N, an all-gather sends its shard to N-1 peers, a send sends everything.

`comm_timeline()` records when: a `Span` of host time (time.perf_counter) per blocking collective,
per posting of sends and receives, and per wait on them, so a step's time splits into compute
(between spans), collectives, transfers in flight (posted, not yet waited) and waiting. Compute that
a strategy names (PipeFusion's patches: `computing(group, tag)`) is a span too. On a GPU the host
clock sees launches: kernels and NCCL run later, on the device's streams.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommRecord:
    op: str
    group: str
    group_size: int
    dtype: str
    elements: int
    bytes: int
    bytes_out: int
    tag: str = ""


class CommLog:
    def __init__(self):
        self.records: list[CommRecord] = []

    def __len__(self):
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def filter(self, *, op: str | None = None, group: str | None = None) -> list[CommRecord]:
        return [r for r in self.records if (op is None or r.op == op) and (group is None or r.group == group)]

    def bytes_by_group(self, field: str = "bytes_out") -> dict[str, int]:
        totals: dict[str, int] = {}
        for r in self.records:
            totals[r.group] = totals.get(r.group, 0) + getattr(r, field)
        return totals

    def summary(self) -> list[dict]:
        """Small, picklable rows (one per record) for views gathered from many ranks."""
        return [asdict(r) for r in self.records]


_OPEN_LOGS: list[CommLog] = []


@contextlib.contextmanager
def _recording(recorder, recorders: list):
    """`recorder` among `recorders`, the open ones every collective reports to, for the duration of the block."""
    recorders.append(recorder)
    try:
        yield recorder
    finally:
        recorders.remove(recorder)


def comm_log():
    """Record every collective issued inside the block (nested logs each see all records)."""
    return _recording(CommLog(), _OPEN_LOGS)


@dataclass(frozen=True)
class Span:
    kind: str  # "collective" (blocking), "post" (sends and receives started), "wait" or "compute" (named)
    op: str
    group: str
    tag: str
    start_s: float
    end_s: float
    bytes_out: int = 0
    posting: int = -1  # a post: its number in this process
    completes: tuple = ()  # a wait: the numbers of the postings it completed


class CommTimeline:
    def __init__(self):
        self.spans: list[Span] = []
        self.start_s = time.perf_counter()
        self.end_s = self.start_s

    def rows(self) -> list[dict]:
        """Picklable rows, seconds from the start of the timeline."""
        return [dict(asdict(s), start_s=s.start_s - self.start_s, end_s=s.end_s - self.start_s) for s in self.spans]


_OPEN_TIMELINES: list[CommTimeline] = []


@contextlib.contextmanager
def comm_timeline():
    """Record the host time of every collective, posting and wait inside the block."""
    with _recording(CommTimeline(), _OPEN_TIMELINES) as timeline:
        try:
            yield timeline
        finally:
            timeline.end_s = time.perf_counter()


_POSTINGS = itertools.count()


@contextlib.contextmanager
def _timed(kind: str, op: str, group: str, tag: str, bytes_out: int = 0, **numbers):
    if not _OPEN_TIMELINES:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:  # PipeFusion's stages end their blocks by raising (models/pipefusion/stage.py): still a span
        span = Span(kind, op, group, tag, start, time.perf_counter(), bytes_out, **numbers)
        for timeline in _OPEN_TIMELINES:
            timeline.spans.append(span)


def computing(group: str, tag: str):
    """`with computing("pipefusion", "patch 2"): ...`: the block's host time as a "compute" span of
    the open timelines, so a view can say what was computed when (nothing moves: no log record)."""
    return _timed("compute", "compute", group, tag)


def _recorded(op: str, group: str, size: int, tensor: torch.Tensor, bytes_out: int, tag: str = ""):
    """Record a blocking collective in the open logs, and time the block it wraps."""
    _record(op, group, size, tensor, bytes_out, tag)
    return _timed("collective", op, group, tag, bytes_out)


def _record(op: str, group: str, size: int, tensor: torch.Tensor, bytes_out: int, tag: str = ""):
    if not _OPEN_LOGS:
        return
    record = CommRecord(
        op=op,
        group=group,
        group_size=size,
        dtype=str(tensor.dtype).replace("torch.", ""),
        elements=tensor.numel(),
        bytes=tensor.numel() * tensor.element_size(),
        bytes_out=bytes_out,
        tag=tag,
    )
    for log in _OPEN_LOGS:
        log.records.append(record)


# ---- handles: how a compiled graph's operators find a mesh or a model's state -------------------------

_HANDLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def handle(obj) -> int:
    """An int that names `obj` to a custom operator (operators take no Python objects); held weakly."""
    _HANDLES[id(obj)] = obj
    return id(obj)


def from_handle(key: int):
    obj = _HANDLES.get(key)
    if obj is None:
        raise RuntimeError("a compiled graph refers to a mesh or model that has been freed; compile it again")
    return obj


# ---- collectives ---------------------------------------------------------------------------------


def all_to_all(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], mesh, group: str, *, tag: str = ""):
    """Send the j-th piece of the flat `send` (send_sizes[j] elements) to group rank j; return
    what arrives, flat, source by source (recv_sizes[j] elements from group rank j).

    Sizes may differ between ranks (uneven sequence shards), so nothing is padded. Callers lay
    out `send` themselves, in one copy, and read the result through views: one call, no
    list-to-buffer copies here."""
    n = mesh.group_size(group)
    if len(send_sizes) != n or len(recv_sizes) != n:
        raise ValueError(
            f"all_to_all over {group} needs {n} send and {n} receive sizes, got {len(send_sizes)} and {len(recv_sizes)}"
        )
    if n == 1:
        return send
    me = mesh.group_rank(group)
    received = send.new_empty(sum(recv_sizes), dtype=send.dtype)  # every rank sends this dtype
    with _recorded("all_to_all", group, n, send, (send.numel() - send_sizes[me]) * send.element_size(), tag):
        dist.all_to_all_single(
            received, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=mesh.group(group)
        )
    return received


def all_gather(
    x: torch.Tensor, mesh, group: str, *, dim: int, sizes: list[int] | None = None, tag: str = ""
) -> torch.Tensor:
    """Concatenate every group rank's `x` along `dim`, in group-rank order.

    `sizes` gives each rank's length along dim when they differ (as torch.tensor_split gives
    them); shards are padded to the longest for the transfer and trimmed after."""
    n = mesh.group_size(group)
    if n == 1:
        return x
    if torch.compiler.is_compiling():  # one opaque operator in the graph: the same transfer and record, run eagerly
        return torch.ops.xdit_lab.all_gather(x, mesh.handle, group, dim, list(sizes or []), tag)
    longest = max(sizes) if sizes else x.shape[dim]
    padded = x
    if x.shape[dim] < longest:
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad_shape, dtype=x.dtype)], dim=dim)
    padded = padded.contiguous()
    out = [torch.empty_like(padded, dtype=padded.dtype) for _ in range(n)]
    with _recorded("all_gather", group, n, padded, padded.numel() * padded.element_size() * (n - 1), tag):
        dist.all_gather(out, padded, group=mesh.group(group))
    if sizes:
        out = [part.narrow(dim, 0, size) for part, size in zip(out, sizes)]
    return torch.cat(out, dim=dim)


@torch.library.custom_op("xdit_lab::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, mesh: int, group: str, dim: int, sizes: list[int], tag: str) -> torch.Tensor:
    return all_gather(x, from_handle(mesh), group, dim=dim, sizes=sizes or None, tag=tag)


@_all_gather_op.register_fake
def _(x, mesh, group, dim, sizes, tag):
    shape = list(x.shape)
    shape[dim] = sum(sizes) if sizes else x.shape[dim] * from_handle(mesh).group_size(group)
    return x.new_empty(shape)


def all_reduce(x: torch.Tensor, mesh, group: str, *, op=dist.ReduceOp.SUM, tag: str = "") -> torch.Tensor:
    """In-place all-reduce of `x` over the group; returns x.

    Under torch.compile it is one opaque operator of the graph (xdit_lab::all_reduce), as all_gather is: dynamo
    would otherwise turn dist.all_reduce into torch's functional collective, which stays in the graph, but the
    record around it is Python that runs once, at trace time; dynamo replays that trace-time list of records after
    each call (`log.records[:] = ...`), which drops what the graph's own operators recorded while it ran (tp's
    gathered modulations). The operator records when it runs, every call."""
    n = mesh.group_size(group)
    if n == 1:
        return x
    if torch.compiler.is_compiling():
        torch.ops.xdit_lab.all_reduce(x, mesh.handle, group, _REDUCE_OPS.index(op), tag)
        return x
    with _recorded("all_reduce", group, n, x, 2 * x.numel() * x.element_size() * (n - 1) // n, tag):
        dist.all_reduce(x, op=op, group=mesh.group(group))
    return x


_REDUCE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)  # an operator takes the op by index


@torch.library.custom_op("xdit_lab::all_reduce", mutates_args=("x",))
def _all_reduce_op(x: torch.Tensor, mesh: int, group: str, op: int, tag: str) -> None:
    all_reduce(x, from_handle(mesh), group, op=_REDUCE_OPS[op], tag=tag)


@_all_reduce_op.register_fake
def _(x, mesh, group, op, tag):
    return None


def all_gather_object(obj, mesh, group: str, *, tag: str = "") -> list:
    """Gather a small picklable object from every group rank (for consistency checks)."""
    n = mesh.group_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    with _recorded("all_gather_object", group, n, torch.empty(0, dtype=torch.uint8), 0, tag):
        dist.all_gather_object(out, obj, group=mesh.group(group))
    return out


def broadcast(x: torch.Tensor, mesh, group: str, *, src_group_rank: int = 0, tag: str = "") -> torch.Tensor:
    n = mesh.group_size(group)
    if n == 1:
        return x
    src = mesh.group_ranks(group)[src_group_rank]
    sent = x.numel() * x.element_size() * (n - 1) if mesh.rank == src else 0
    with _recorded("broadcast", group, n, x, sent, tag):
        dist.broadcast(x, src=src, group=mesh.group(group))
    return x


# ---- FSDP2's all-gathers of sharded weights -----------------------------------------------------------


def weights_all_gather(mesh, group: str, *, tag: str = "weights"):
    """The all-gather to hand torch's FSDP2 (`FSDPModule.set_custom_all_gather`): torch's own
    (`DefaultAllGather`, one `dist.all_gather_single` of the unit's padded shards, concatenated), each
    call recorded here under `group` with `tag`, like every other collective: `bytes` is this rank's
    shard of the unit, `bytes_out` that times N-1, as `all_gather` counts it. It runs on FSDP2's
    all-gather stream on a GPU (no host sync here); an asynchronous call (FSDP2's async_op) is a
    posting in the timeline, the blocking ones a collective."""
    return _recorded_fsdp_all_gather()(mesh, group, tag)


@functools.cache
def _recorded_fsdp_all_gather():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class RecordedAllGather(DefaultAllGather):
        def __init__(self, mesh, group: str, tag: str):
            super().__init__()
            self.mesh, self.group, self.tag = mesh, group, tag

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            n = group.size()
            sent = input_tensor.numel() * input_tensor.element_size() * (n - 1)
            _record("all_gather", self.group, n, input_tensor, sent, self.tag)
            kind = "post" if async_op else "collective"
            with _timed(kind, "all_gather", self.group, self.tag, sent):
                return super().__call__(output_tensor, input_tensor, group, async_op)

    return RecordedAllGather


# ---- point to point ---------------------------------------------------------------------------------


def exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], mesh, group: str, *, tag: str = ""
):
    """Start sends and receives together (batch_isend_irecv); return the requests to wait on.

    `sends` and `recvs` pair a tensor with a global peer rank. Receives are filled in place. Each
    message travels on the communicator RankMesh.p2p_group names for its direction (under "pipefusion"
    the two-rank link: a send to `peer` on rank -> peer, a receive from it on peer -> rank; otherwise
    the group's own), one batch per communicator.
    CUDA tensors over gloo (ranks sharing a GPU) travel through host copies: gloo's send and recv
    read and write host memory only, and given a device pointer fail ("writev ...: Bad address")."""
    batches: dict = {}  # communicator -> its P2POps and, per op index, the device tensor a receive lands in
    sent, size = 0, mesh.group_size(group)
    for direction, pairs in (("send", sends), ("recv", recvs)):
        for tensor, peer in pairs:
            src, dst = (mesh.rank, peer) if direction == "send" else (peer, mesh.rank)
            pg = mesh.p2p_group(group, src, dst)
            ops, landing = batches.setdefault(pg, ([], {}))
            through_host = tensor.is_cuda and dist.get_backend(pg) == "gloo"
            if direction == "send":
                tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
                _record("send", group, size, tensor, tensor.numel() * tensor.element_size(), tag)
                sent += tensor.numel() * tensor.element_size()
                ops.append(dist.P2POp(dist.isend, tensor.cpu() if through_host else tensor, peer, group=pg))
            else:
                if through_host:
                    landing[len(ops)] = tensor
                    tensor = torch.empty(tensor.shape, dtype=tensor.dtype)
                ops.append(dist.P2POp(dist.irecv, tensor, peer, group=pg))
    requests = []
    posting = next(_POSTINGS) if _OPEN_TIMELINES else -1
    with _timed("post", "exchange", group, tag, sent, posting=posting):
        for ops, landing in batches.values():
            posted = dist.batch_isend_irecv(ops)
            if landing:  # gloo returns one request per op, in order
                posted = [_Landing(r, ops[i].tensor, landing[i]) if i in landing else r for i, r in enumerate(posted)]
            requests += posted
    if _OPEN_TIMELINES:  # what a wait is waiting for, for its span
        requests = [_Named(r, group, tag, posting) for r in requests]
    return requests


class _Landing:
    """A receive into a host buffer whose wait copies the bytes into the device tensor asked for."""

    def __init__(self, request, host: torch.Tensor, target: torch.Tensor):
        self.request, self.host, self.target = request, host, target

    def wait(self):
        self.request.wait()
        self.target.copy_(self.host)
        return True


class _Named:
    """A request that knows its group and tag, so that waiting on it is drawn in the right lane."""

    def __init__(self, request, group: str, tag: str, posting: int):
        self.request, self.group, self.tag, self.posting = request, group, tag, posting

    def wait(self):
        return self.request.wait()


def wait(requests: list) -> None:
    if not requests:
        return
    named = [r for r in requests if isinstance(r, _Named)]
    group, tag = (named[0].group, named[0].tag) if named else ("", "")
    with _timed("wait", "wait", group, tag, completes=tuple(sorted({r.posting for r in named}))):
        for request in requests:
            request.wait()
