"""PipeFusion's two schedules side by side on the bundled digits model: drained against async.

    python benchmarks/pipefusion_schedule.py                      # 10 per digit, 2 and 4 patches, 3 repeats
    python benchmarks/pipefusion_schedule.py --per-digit 1 --steps 4 --repeats 1 --json rows.json

On 2 ranks (pipefusion 2, 1 warmup step, the model's own 20 steps unless --steps), each schedule
draws the same batch (per_digit images of each digit: one batch of 10 × per_digit prompts, twice
the rows with guidance), interleaved (drained, async, drained, ...) and repeated. Per run and rank:
  - seconds of the K pipelined steps (those after the warmup), the slowest rank's;
  - the bubble: the share of those seconds a stage spent outside its blocks (the stage report's busy_s,
    host time around each patch's blocks), beside the closed form for N stages, M patches, equal
    stage times and free messages: drained (N-1)/(M+N-1), async (N-1)/(K·M+N-1);
  - the async latents' largest deviation from the drained ones (relative to their largest value).
The predicted time ratio async / drained is (K·M+N-1) / (K·(M+N-1)). Ranks run one thread each
and share this machine's cores, and a stage's blocks are not its whole cost (stage 0 embeds, the
last stage projects, guides and steps the scheduler): read the bubble beside its formula, and the
time ratio as the schedule's effect on this model at this size. The measuring is
xdit_lab.lessons.schedules, which tutorial 06 runs on its Lab.
"""

from __future__ import annotations

import argparse
import json

from xdit_lab import ParallelConfig
from xdit_lab.digits import prompt_for
from xdit_lab.lessons.schedules import markdown, run_schedules, schedule_table
from xdit_lab.testing import run_on_ranks


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-digit", type=int, default=10)
    parser.add_argument("--patches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    configs = [
        ParallelConfig(pipefusion=2, num_patches=m, warmup_steps=1, pipefusion_schedule=schedule)
        for m in args.patches
        for schedule in ("drained", "async")
    ]
    prompts = [prompt_for(d) for d in range(10) for _ in range(args.per_digit)]
    per_rank = run_on_ranks(run_schedules, 2, configs, prompts, args.steps, args.repeats, timeout_s=3600)
    table = schedule_table(per_rank)
    print(markdown(table))
    if args.json:
        rows = [{k: v for k, v in r.items() if k != "latents"} for r in table]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
