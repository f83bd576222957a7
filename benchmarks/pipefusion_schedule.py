"""PipeFusion's two schedules side by side on the bundled digits model: drained against async.

    python benchmarks/pipefusion_schedule.py                      # 10 per digit, 2 and 4 patches, 3 repeats
    python benchmarks/pipefusion_schedule.py --per-digit 1 --steps 4 --repeats 1 --json rows.json

On 2 ranks (pipefusion 2, 1 warmup step, the model's own 20 steps unless --steps), each schedule
draws the same batch (per_digit images of each digit: one batch of 10 × per_digit prompts, twice
the rows with guidance), interleaved (drained, async, drained, ...) and repeated. Per run and rank:
  - seconds of the K pipelined steps (those after the warmup), the slowest rank's;
  - the bubble: the share of those seconds a stage spent outside its blocks (PipeFusionStage.busy_s,
    host time around each patch's blocks), beside the closed form for N stages, M patches, equal
    stage times and free messages: drained (N-1)/(M+N-1), async (N-1)/(K·M+N-1);
  - the async latents' largest deviation from the drained ones (relative to their largest value).
The predicted time ratio async / drained is (K·M+N-1) / (K·(M+N-1)). Ranks run one thread each
and share this machine's cores, and a stage's blocks are not its whole cost (stage 0 embeds, the
last stage projects, guides and steps the scheduler): read the bubble beside its formula, and the
time ratio as the schedule's effect on this model at this size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from xdit_lab import ParallelConfig, RankMesh, load_pipeline
from xdit_lab.digits import prompt_for
from xdit_lab.models import parallel_state
from xdit_lab.testing import run_on_ranks


def closed_form_bubble(config: ParallelConfig, pipelined_steps: int) -> float:
    n, m = config.pipefusion, config.patches
    if config.pipefusion_schedule == "async":
        return (n - 1) / (pipelined_steps * m + n - 1)
    return (n - 1) / (m + n - 1)


def run_schedules(configs, per_digit, steps, repeats):
    """On one rank: every configuration once per repeat, interleaved."""
    torch.set_num_threads(1)
    prompts = [prompt_for(d) for d in range(10) for _ in range(per_digit)]
    pipes = [load_pipeline("digits", c, mesh=RankMesh(c), progress=False) for c in configs]
    rows = []
    for repeat in range(repeats):
        for config, pipe in zip(configs, pipes):
            stage = parallel_state(pipe.diffusers_pipeline.transformer).strategy
            session = pipe.session(prompts, seed=0, **({"num_inference_steps": steps} if steps else {}))
            for _ in range(config.warmup_steps):
                session.step()
            busy, started = stage.busy_s, time.perf_counter()
            session.run()
            seconds = time.perf_counter() - started
            rows.append(
                dict(
                    config=config,
                    repeat=repeat,
                    stage=pipe.mesh.coords["pipefusion"],
                    pipelined_steps=session.num_steps - config.warmup_steps,
                    seconds=seconds,
                    bubble=1 - (stage.busy_s - busy) / seconds,
                    latents=session.latents.clone() if repeat == 0 else None,
                )
            )
    return rows


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per configuration: the slowest rank's seconds over repeats, each stage's bubble."""
    table = []
    for config in dict.fromkeys(r["config"] for r in per_rank[0]):
        runs = [[r for r in rank if r["config"] == config] for rank in per_rank]
        seconds = [max(rank[i]["seconds"] for rank in runs) for i in range(len(runs[0]))]
        pipelined = runs[0][0]["pipelined_steps"]
        table.append(
            dict(
                config=config.short(),
                patches=config.patches,
                pipelined_steps=pipelined,
                median_s=statistics.median(seconds),
                spread_s=(min(seconds), max(seconds)),
                bubble_by_stage=[statistics.median(r["bubble"] for r in rank) for rank in runs],
                closed_form_bubble=closed_form_bubble(config, pipelined),
                latents=runs[0][0]["latents"],
            )
        )
    for row in table:  # each async row beside the drained one with the same patches
        if row["config"].endswith("async"):
            drained = next(r for r in table if r["patches"] == row["patches"] and not r["config"].endswith("async"))
            k, m, n = row["pipelined_steps"], row["patches"], 2
            row["vs_drained"] = row["median_s"] / drained["median_s"]
            row["closed_form_vs_drained"] = (k * m + n - 1) / (k * (m + n - 1))
            difference = (row["latents"] - drained["latents"]).abs().max()
            row["deviation"] = (difference / drained["latents"].abs().max()).item()
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| schedule | patches | pipelined steps | median s | spread s | bubble per stage (measured) | "
        "bubble (closed form) | async / drained (measured) | (closed form) | deviation from drained |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in table:
        lines.append(
            f"| {r['config']} | {r['patches']} | {r['pipelined_steps']} | {r['median_s']:.2f} | "
            f"{r['spread_s'][0]:.2f}-{r['spread_s'][1]:.2f} | {' / '.join(f'{b:.3f}' for b in r['bubble_by_stage'])} | "
            f"{r['closed_form_bubble']:.3f} | {r.get('vs_drained', float('nan')):.3f} | "
            f"{r.get('closed_form_vs_drained', float('nan')):.3f} | {r.get('deviation', float('nan')):.1e} |"
        )
    return "\n".join(lines)


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
    per_rank = run_on_ranks(run_schedules, 2, configs, args.per_digit, args.steps, args.repeats, timeout_s=3600)
    table = summarize(per_rank)
    print(markdown(table))
    if args.json:
        rows = [{k: v for k, v in r.items() if k != "latents"} for r in table]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
