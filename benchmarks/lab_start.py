"""How long a user waits for the Lab: engines forked from one process that imported the libraries once, beside
ipyparallel's own local launcher (fresh interpreters), on this machine, in one run.

    python benchmarks/lab_start.py                      # 2 CPU engines, 3 repeats of each launcher, interleaved
    python benchmarks/lab_start.py --engines 2 --repeats 3 --json out.json
    python benchmarks/lab_start.py --before /path/to/old-checkout/.venv/bin/python   # and an earlier commit's Lab

Each repeat is a fresh Python process, as a notebook's kernel is, that runs what a user's first cells run:

  start        Lab(n)                                 (controller, engines, torch.distributed)
  first load   lab.load("digits", ParallelConfig(cfg=2))
  restart      lab.restart()                          (fresh engines, the pipeline loaded again)
  stop         lab.stop()
  second Lab   Lab(n) then its load, in the same process (a notebook's next Lab; the test suite's many)

The launchers alternate (spawned, forked, spawned, ...) so that a machine that slows down mid-run slows both.
Medians of the repeats; the target of issue 59: forked start + first load at most half of what it was before
(`--before`: the Lab of another checkout, run by its own interpreter with its defaults, as a third column).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PHASES = ("start", "first load", "start + first load", "restart", "stop", "second Lab + load")


def one_life(engines: int, launcher: str) -> dict:
    """The phases of one Lab's life in this (fresh) process, in seconds."""
    from xdit_lab import ParallelConfig
    from xdit_lab.lab import Lab

    config = ParallelConfig(cfg=2) if engines >= 2 else ParallelConfig()
    options = {} if launcher == "before" else dict(fork_engines=launcher == "forked")  # before: its own default
    times = {}
    began = time.perf_counter()
    lab = Lab(engines, **options)
    times["start"] = time.perf_counter() - began
    began = time.perf_counter()
    lab.load("digits", config)
    times["first load"] = time.perf_counter() - began
    times["start + first load"] = times["start"] + times["first load"]
    began = time.perf_counter()
    lab.restart()
    times["restart"] = time.perf_counter() - began
    began = time.perf_counter()
    lab.stop()
    times["stop"] = time.perf_counter() - began
    began = time.perf_counter()
    with Lab(engines, **options) as second:
        second.load("digits", config)
        times["second Lab + load"] = time.perf_counter() - began
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--before", help="the python of another checkout (its venv), timed as a third launcher")
    parser.add_argument("--one", choices=("spawned", "forked", "before"), help=argparse.SUPPRESS)  # one repeat
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_life(args.engines, args.one)))
        return

    from xdit_lab.tools.calibrate import cpu_model

    launchers = ["spawned", "forked"] + (["before"] if args.before else [])
    runs = {launcher: [] for launcher in launchers}
    for repeat in range(args.repeats):
        for launcher in launchers[repeat % len(launchers) :] + launchers[: repeat % len(launchers)]:
            python = args.before if launcher == "before" else sys.executable
            command = [python, __file__, "--engines", str(args.engines), "--one", launcher]
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
            runs[launcher].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {name: {p: statistics.median(r[p] for r in lives) for p in PHASES} for name, lives in runs.items()}
    print(f"Lab({args.engines}) on {cpu_model()}, median of {args.repeats} fresh processes per launcher (s):")
    columns = "".join(f"{launcher:>9}" for launcher in launchers)
    ratios = "forked/spawned" + ("  forked/before" if args.before else "")
    print(f"{'phase':<22}{columns}  {ratios}")
    for phase in PHASES:
        row = "".join(f"{medians[launcher][phase]:>9.2f}" for launcher in launchers)
        ratio = f"{medians['forked'][phase] / medians['spawned'][phase]:>14.2f}"
        if args.before:
            ratio += f"{medians['forked'][phase] / medians['before'][phase]:>15.2f}"
        print(f"{phase:<22}{row}  {ratio}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                dict(engines=args.engines, cpu=cpu_model(), before=args.before, runs=runs, medians=medians),
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
