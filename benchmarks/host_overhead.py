"""Host time per step, on rank 0 of torch's fake process group, beside diffusers: what a GPU step pays
on the host (Python, hooks, launches) when the kernels and the links cost next to nothing.

    python benchmarks/host_overhead.py                          # 2 and 4 ranks, median of 15
    python benchmarks/host_overhead.py --ranks 2 --repeats 15 --json out.json --markdown out.md
    python benchmarks/host_overhead.py --ranks 2 --profile "ours ulysses2"   # where that method's time goes
    python benchmarks/host_overhead.py --device cuda --shape flux-1-dev --traces traces/   # on one GPU

What is timed: one forward of a Flux-shaped transformer at FLUX.1-dev's depth (19 double-stream and 38
single-stream blocks) and a tiny width (4 heads x 16, 64 image and 16 text tokens, fp32, one thread), in
one process that is rank 0 of a world of N ranks on the "fake" backend
(`torch.testing._internal.distributed.fake_pg.FakeStore`): every collective returns at once without
moving anything, so the time left is the host's: diffusers' forward, the parallel hooks and kernels'
Python, the collectives' bookkeeping. (The outputs are garbage, as nothing arrives; exactness is the
tests' and peers.py's to show.) Methods, interleaved (A, B, C, B, C, A, ...: each repeat starts one method later), median of the
repeats:

  serial                     diffusers' forward as it is (no process group involved)
  diffusers ulysses<N>       diffusers' own context parallelism (`enable_parallelism`,
                             `ContextParallelConfig(ulysses_degree=N)`)
  ours ulysses<N>, ring<N>   xdit_lab.parallelize
  ours serial                xdit_lab.parallelize with every degree 1 (nothing to split: no hook at all)

Ratios beside the targets of issue 42: ours ulysses / diffusers ulysses <= 0.85, ring / ulysses <= 1.15,
ours with every degree 1 / serial <= 1.05; of the medians (the targets'), and of the fastest repeats (on a
machine shared with others, the least disturbed estimate of the same cost). Every world size runs in its
own process (a fresh fake group).
`--profile METHOD` runs that method under cProfile after the timing and prints where its time goes.

On a GPU (`--device cuda`): the same methods on one GPU, still rank 0 of a fake world (the collectives
move nothing, so what is left is the rank's own work), with three figures per forward:

  host ms   until the forward returns to Python (kernels launched, not waited for)
  step ms   from CUDA events around the forward, started on an idle GPU: when its last kernel ended
  GPU ms    the union of its CUDA kernels' intervals in a torch.profiler trace (median of 3 forwards)

"host-bound" where host ms exceeds GPU ms: the GPU waits on Python and launches, and a faster GPU would
not make the step faster. `--shape flux-1-dev` times FLUX.1-dev's real transformer (random weights, bf16,
4096 image + 512 text tokens: 1024 x 1024 pixels; the methods share one copy of the 24 GB of weights);
`--traces DIR` writes one gzipped Chrome trace per method and world (chrome://tracing or Perfetto).
cfg and dp are not timed here: a rank of either runs the serial forward on its share of the batch; nor is
PipeFusion, whose stages run a patch at a time from the session (benchmarks/pipefusion_schedule.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gzip
import io
import json
import multiprocessing
import os
import pstats
import statistics
import time
import warnings
from unittest import mock

import torch

DOUBLE, SINGLE = 19, 38  # FLUX.1-dev's blocks (REAL-MODELS.md)
IMAGE_SIDE, TEXT_TOKENS = 8, 16  # 8 x 8 latent pixels: 64 image tokens (Flux's tiny spec patches 1 x 1)
TARGETS = {"ours ulysses / diffusers ulysses": 0.85, "ring / ulysses": 1.15, "ours every degree 1 / serial": 1.05}
SHAPES = ("tiny", "flux-1-dev")
FORWARD_MARK = "host_overhead.forward"  # the profiler's range around each profiled forward
FLUX_IMAGE_TOKENS, FLUX_TEXT_TOKENS = 4096, 512  # 1024 x 1024 pixels, FLUX.1-dev's max_sequence_length


def build(double: int, single: int, shape: str = "tiny", device: str = "cpu"):
    """The Flux-shaped transformer and its inputs, one sample, on `device`: at xdit_lab.tiny's width
    (fp32), or FLUX.1-dev's own (bf16, random weights, benchmarks/linear_rows.py builds it)."""
    if shape == "flux-1-dev":
        from linear_rows import FLUX_1_DEV, flux_1_dev

        config = dict(FLUX_1_DEV, num_layers=double, num_single_layers=single)
        return flux_1_dev(config, FLUX_IMAGE_TOKENS, FLUX_TEXT_TOKENS, device=device)
    from xdit_lab.tiny import tiny_inputs, tiny_transformer

    model = tiny_transformer("flux", seed=0, layers=double, num_single_layers=single).to(device)
    inputs = tiny_inputs("flux", 1, height=IMAGE_SIDE, width=IMAGE_SIDE, text_len=TEXT_TOKENS)
    return model, {key: value.to(device) if torch.is_tensor(value) else value for key, value in inputs.items()}


def sharing_weights(model):
    """A second module like `model` whose parameters and buffers are `model`'s own tensors: neither
    enable_parallelism nor parallelize (weights whole) changes a weight, so the methods share one copy
    (FLUX.1-dev's 24 GB once on the GPU, not five times)."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


def methods_for(world: int, model) -> dict:
    """{name: model} on rank 0 of the fake world: serial, diffusers' CP, ours."""
    from diffusers import ContextParallelConfig

    from xdit_lab import ParallelConfig, RankMesh, parallelize

    peer = sharing_weights(model)
    with _one_device_per_rank():
        peer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    methods = {"serial": model, f"diffusers ulysses{world}": peer}
    for config in (ParallelConfig(ulysses=world), ParallelConfig(ring=world), ParallelConfig()):
        methods[f"ours {config.short()}"] = parallelize(sharing_weights(model), config, RankMesh(config))
    return methods


@contextlib.contextmanager
def _one_device_per_rank():
    """diffusers takes rank % torch.accelerator.device_count() for a rank's device: 0 devices on a CPU
    (benchmarks/peers.py says more)."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def forward(model, inputs):
    with torch.inference_mode():
        return model(**inputs, return_dict=False)[0]


def measure_world(
    world: int,
    repeats: int,
    double: int,
    single: int,
    profile: str | None,
    device: str = "cpu",
    shape: str = "tiny",
    traces: str | None = None,
) -> dict:
    """In a fresh process: rank 0 of a fake world of `world` ranks; every method timed, interleaved. On a
    GPU also each forward's step time (CUDA events) and each method's GPU busy time (torch.profiler)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from xdit_lab.distributed import shutdown_distributed

    torch.set_num_threads(1)
    _quiet()
    cuda = torch.device(device).type == "cuda"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model, inputs = build(double, single, shape, device)
        methods = methods_for(world, model)
        for model in methods.values():  # warm-up (twice: first calls build caches)
            forward(model, inputs)
            forward(model, inputs)
        times = {name: [] for name in methods}
        steps = {name: [] for name in methods}
        names = list(methods)
        for repeat in range(repeats):  # interleaved, each repeat starting one method later (no fixed order)
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                host, step = timed(methods[name], inputs, cuda)
                times[name].append(host)
                steps[name].append(step)
        report = None
        if profile:
            if profile not in methods:
                raise SystemExit(f"--profile {profile!r}: not one of {sorted(methods)}")
            report = profiled(methods[profile], inputs)
        result = dict(world=world, ms=times, profile=report)
        if cuda:
            result["step_ms"] = steps
            result["gpu_ms"] = {name: gpu_busy_ms(methods[name], inputs, traces, f"{name}.{world}") for name in names}
        return result
    finally:
        shutdown_distributed()


def timed(model, inputs, cuda: bool) -> tuple[float, float]:
    """(host ms: until the forward returns, step ms: until its last kernel ends). On a CPU both are the
    host's. On a GPU the step starts on an idle GPU (synchronized before) and is read after it ends."""
    if not cuda:
        start = time.perf_counter()
        forward(model, inputs)
        host = (time.perf_counter() - start) * 1e3
        return host, host
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    began.record()
    start = time.perf_counter()
    forward(model, inputs)
    host = (time.perf_counter() - start) * 1e3
    ended.record()
    torch.cuda.synchronize()  # outside the timed forward: only to read the events
    return host, began.elapsed_time(ended)


def gpu_busy_ms(model, inputs, traces: str | None, name: str, calls: int = 3) -> float:
    """The median over `calls` forwards of the time at least one CUDA kernel ran (the union of kernel
    intervals in a torch.profiler trace; kernels on other streams overlap, not add); with `traces`, the
    trace written there as NAME.json.gz."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for call in range(calls):
            torch.cuda.synchronize()  # forwards apart: each one's kernels end before the next one starts
            with record_function(f"{FORWARD_MARK}{call}"):
                forward(model, inputs)
        torch.cuda.synchronize()
    events = prof.events()
    starts = sorted(e.time_range.start for e in events if e.name.startswith(FORWARD_MARK))
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kernels or len(starts) != calls:
        raise RuntimeError(
            f"{name}: the profiler saw {len(kernels)} CUDA kernels and {len(starts)} of {calls} forwards"
        )
    busy = union_per_call(kernels, starts)
    if traces:
        os.makedirs(traces, exist_ok=True)
        raw = os.path.join(traces, f"{name.replace(' ', '_')}.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(f"{raw}.gz.partial", "wb") as out:
            out.write(f.read())
        os.replace(f"{raw}.gz.partial", f"{raw}.gz")
        os.remove(raw)
    return statistics.median(busy)


def union_per_call(kernels: list[tuple[float, float]], starts: list[float]) -> list[float]:
    """Kernel intervals (µs, sorted by start) of forwards that began on the host at `starts` (µs, the same
    clock), each on an idle GPU: a kernel belongs to the last forward begun before it. The union of each
    forward's intervals, in ms (0 for a forward without kernels)."""
    busy = []
    for first, following in zip(starts, [*starts[1:], float("inf")]):
        total, end = 0.0, None
        for s, e in (k for k in kernels if first <= k[0] < following):
            if end is None or s > end:
                total, end = total + e - s, e
            elif e > end:
                total, end = total + e - end, e
        busy.append(total / 1e3)
    return busy


def profiled(model, inputs, calls: int = 5, top: int = 25) -> str:
    """cProfile of `calls` forwards: the functions with the most time of their own."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        forward(model, inputs)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _quiet():
    """diffusers warns that enable_parallelism is experimental, and its functional collectives warn on the
    fake group that nothing waits on their outputs (nothing arrives to wait for)."""
    from diffusers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def ratios(result: dict, statistic=statistics.median) -> dict[str, float]:
    """The issue's ratios from one world's medians (or another statistic of the repeats, e.g. min)."""
    world, med = result["world"], {name: statistic(ms) for name, ms in result["ms"].items()}
    return {
        "ours ulysses / diffusers ulysses": med[f"ours ulysses{world}"] / med[f"diffusers ulysses{world}"],
        "ring / ulysses": med[f"ours ring{world}"] / med[f"ours ulysses{world}"],
        "ours every degree 1 / serial": med["ours serial"] / med["serial"],
    }


def table(results: list[dict]) -> str:
    lines = ["| ranks | method | median ms | spread ms | median / serial's |", "| --- | --- | --- | --- | --- |"]
    for result in results:
        serial = statistics.median(result["ms"]["serial"])
        for name, ms in result["ms"].items():
            med = statistics.median(ms)
            lines.append(
                f"| {result['world']} | {name} | {med:.1f} | {min(ms):.1f}-{max(ms):.1f} | {med / serial:.2f} |"
            )
    lines += [
        "",
        "| ranks | ratio | of medians | of minimums | target | met (medians)? |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        fastest = ratios(result, min)
        for name, value in ratios(result).items():
            target = TARGETS[name]
            lines.append(
                f"| {result['world']} | {name} | {value:.2f} | {fastest[name]:.2f} | <= {target:.2f} "
                f"| {'yes' if value <= target else 'no'} |"
            )
    if any("gpu_ms" in result for result in results):
        lines += [
            "",
            "| ranks | method | host ms | step ms | GPU ms | GPU idle in the step | host-bound (host > GPU)? |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for result in results:
            for name, gpu in result["gpu_ms"].items():
                host, step = statistics.median(result["ms"][name]), statistics.median(result["step_ms"][name])
                lines.append(
                    f"| {result['world']} | {name} | {host:.1f} | {step:.1f} | {gpu:.1f} | "
                    f"{max(0.0, 1 - gpu / step):.0%} | {'yes' if host > gpu else 'no'} |"
                )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="fake world sizes (default 2 4)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--double", type=int, default=DOUBLE, help="double-stream blocks (default FLUX.1-dev's 19)")
    parser.add_argument("--single", type=int, default=SINGLE, help="single-stream blocks (default FLUX.1-dev's 38)")
    parser.add_argument("--profile", metavar="METHOD", help='cProfile one method after timing, e.g. "ours ulysses2"')
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: the methods on one GPU")
    parser.add_argument("--shape", choices=SHAPES, default="tiny", help="tiny width (default) or FLUX.1-dev's own")
    parser.add_argument("--traces", metavar="DIR", help="on a GPU: one gzipped Chrome trace per method and world")
    parser.add_argument("--json", help="also write every timing to this file")
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    heads = 24 if args.shape == "flux-1-dev" else 4
    if any(world < 2 or heads % world for world in args.ranks):
        parser.error(f"--ranks: world sizes of 2 or more that divide the {heads} heads of --shape {args.shape}")
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch sees no CUDA device ({torch.__version__})")
    if args.shape == "flux-1-dev" and not cuda:
        parser.error("--shape flux-1-dev: a forward at FLUX.1-dev's size takes minutes on a CPU; use --device cuda")
    if args.traces and not cuda:
        parser.error("--traces: GPU kernel traces need --device cuda")
    spawn = multiprocessing.get_context("spawn")
    results = []
    for world in args.ranks:
        with spawn.Pool(1) as pool:  # a fresh process per world: one fake group each
            measured = (
                world,
                args.repeats,
                args.double,
                args.single,
                args.profile,
                args.device,
                args.shape,
                args.traces,
            )
            results.append(pool.apply(measure_world, measured))
    text = table(results)
    print(text)
    for result in results:
        if result["profile"]:
            print(f"\n{args.profile}, {result['world']} ranks, 5 forwards:\n{result['profile']}")
    if args.json:
        device = torch.cuda.get_device_name() if cuda else "cpu"
        rows = [
            dict(world=r["world"], device=device, shape=args.shape, ms=r["ms"], ratios=ratios(r))
            | dict(ratios_of_minimums=ratios(r, min), step_ms=r.get("step_ms"), gpu_ms=r.get("gpu_ms"))
            for r in results
        ]
        _write_whole(args.json, json.dumps(rows, indent=1))
    if args.markdown:
        _write_whole(args.markdown, text)


def _write_whole(path, text: str):
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
