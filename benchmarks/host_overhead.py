"""Host time per step, on rank 0 of torch's fake process group, beside diffusers: what a GPU step pays
on the host (Python, hooks, launches) when the kernels and the links cost next to nothing.

    python benchmarks/host_overhead.py                          # 2 and 4 ranks, median of 15
    python benchmarks/host_overhead.py --ranks 2 --repeats 15 --json out.json --markdown out.md
    python benchmarks/host_overhead.py --ranks 2 --profile "ours ulysses2"   # where that method's time goes

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
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
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


def build(double: int, single: int):
    """The Flux-shaped transformer (xdit_lab.tiny's width) and its inputs, one sample."""
    from xdit_lab.tiny import tiny_inputs, tiny_transformer

    model = tiny_transformer("flux", seed=0, layers=double, num_single_layers=single)
    inputs = tiny_inputs("flux", 1, height=IMAGE_SIDE, width=IMAGE_SIDE, text_len=TEXT_TOKENS)
    return model, inputs


def methods_for(world: int, model) -> dict:
    """{name: model} on rank 0 of the fake world: serial, diffusers' CP, ours."""
    from diffusers import ContextParallelConfig

    from xdit_lab import ParallelConfig, RankMesh, parallelize

    peer = copy.deepcopy(model)
    with _one_device_per_rank():
        peer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    methods = {"serial": model, f"diffusers ulysses{world}": peer}
    for config in (ParallelConfig(ulysses=world), ParallelConfig(ring=world), ParallelConfig()):
        methods[f"ours {config.short()}"] = parallelize(copy.deepcopy(model), config, RankMesh(config))
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


def measure_world(world: int, repeats: int, double: int, single: int, profile: str | None) -> dict:
    """In a fresh process: rank 0 of a fake world of `world` ranks; every method timed, interleaved."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from xdit_lab.distributed import shutdown_distributed

    torch.set_num_threads(1)
    _quiet()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model, inputs = build(double, single)
        methods = methods_for(world, model)
        for model in methods.values():  # warm-up (twice: first calls build caches)
            forward(model, inputs)
            forward(model, inputs)
        times = {name: [] for name in methods}
        names = list(methods)
        for repeat in range(repeats):  # interleaved, each repeat starting one method later (no fixed order)
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                model = methods[name]
                start = time.perf_counter()
                forward(model, inputs)
                times[name].append((time.perf_counter() - start) * 1e3)
        report = None
        if profile:
            if profile not in methods:
                raise SystemExit(f"--profile {profile!r}: not one of {sorted(methods)}")
            report = profiled(methods[profile], inputs)
        return dict(world=world, ms=times, profile=report)
    finally:
        shutdown_distributed()


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
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="fake world sizes (default 2 4)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--double", type=int, default=DOUBLE, help="double-stream blocks (default FLUX.1-dev's 19)")
    parser.add_argument("--single", type=int, default=SINGLE, help="single-stream blocks (default FLUX.1-dev's 38)")
    parser.add_argument("--profile", metavar="METHOD", help='cProfile one method after timing, e.g. "ours ulysses2"')
    parser.add_argument("--json", help="also write every timing to this file")
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    if any(world < 2 or 4 % world and world % 4 for world in args.ranks):
        parser.error("--ranks: world sizes of 2 or more that divide the 4 heads (2 or 4)")
    spawn = multiprocessing.get_context("spawn")
    results = []
    for world in args.ranks:
        with spawn.Pool(1) as pool:  # a fresh process per world: one fake group each
            results.append(pool.apply(measure_world, (world, args.repeats, args.double, args.single, args.profile)))
    text = table(results)
    print(text)
    for result in results:
        if result["profile"]:
            print(f"\n{args.profile}, {result['world']} ranks, 5 forwards:\n{result['profile']}")
    if args.json:
        rows = [
            dict(world=r["world"], ms=r["ms"], ratios=ratios(r), ratios_of_minimums=ratios(r, min)) for r in results
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
