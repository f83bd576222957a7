"""PipeFusion's two schedules side by side (tutorial 06 and benchmarks/pipefusion_schedule.py).

    closed_form_bubble(config, pipelined_steps)    the share of a stage's time that is idle
    run_schedules(configs, prompts, ...)           (every rank) each configuration on the digits, interleaved
    schedule_table(per_rank)                       the slowest rank's seconds, each stage's bubble, async vs drained
    markdown(table)                                the table as Markdown

The bubble is measured, not assumed: a stage counts the host seconds it spends in its blocks
(its report's busy_s), and the rest of the pipelined steps is idle. The closed form assumes
equal stages and free messages: drained (N-1)/(M+N-1) of every step, async (N-1)/(K·M+N-1) of K
pipelined steps. On a GPU the blocks' kernels run asynchronously, so busy_s counts launching:
measure a GPU's bubble with a profiler.
"""

from __future__ import annotations

import statistics
import time


def closed_form_bubble(config, pipelined_steps: int) -> float:
    """Idle share of a stage over the pipelined steps, for N stages and M patches."""
    n, m = config.pipefusion, config.patches
    if config.pipefusion_schedule == "async":
        return (n - 1) / (pipelined_steps * m + n - 1)
    return (n - 1) / (m + n - 1)


def run_schedules(configs, prompts, steps=None, repeats=1, threads=1) -> list[dict]:
    """On one rank (a torchrun or run_on_ranks process, or a Lab engine): every configuration once
    per repeat, interleaved, drawing `prompts` on the digits model with seed 0. Per run: this stage's
    seconds over the steps after the warmup, its bubble, and (first repeat) the final latents."""
    import torch

    from ..mesh import RankMesh
    from ..models import parallel_state
    from ..pipeline import load_pipeline

    torch.set_num_threads(threads)
    pipes = [load_pipeline("digits", c, mesh=RankMesh(c), progress=False) for c in configs]
    rows = []
    for repeat in range(repeats):
        for config, pipe in zip(configs, pipes):
            stage = parallel_state(pipe.diffusers_pipeline.transformer).strategy
            session = pipe.session(prompts, seed=0, **({"num_inference_steps": steps} if steps else {}))
            for _ in range(config.warmup_steps):
                session.step()
            busy, started = stage.report().busy_s, time.perf_counter()
            session.run()
            seconds = time.perf_counter() - started
            rows.append(
                dict(
                    config=config,
                    repeat=repeat,
                    pipelined_steps=session.num_steps - config.warmup_steps,
                    seconds=seconds,
                    bubble=1 - (stage.report().busy_s - busy) / seconds,
                    latents=session.latents.clone() if repeat == 0 else None,
                )
            )
    return rows


def schedule_table(per_rank: list[list[dict]]) -> list[dict]:
    """One row per configuration: the slowest rank's seconds (median and spread over repeats), each
    stage's median bubble beside the closed form; an async row also its time over the drained row's
    with as many patches (measured and predicted, (K·M+N-1)/(K·(M+N-1))) and its latents' largest
    deviation from the drained ones, relative to their largest value."""
    table = []
    for config in dict.fromkeys(r["config"] for r in per_rank[0]):
        runs = [[r for r in rank if r["config"] == config] for rank in per_rank]
        seconds = [max(rank[i]["seconds"] for rank in runs) for i in range(len(runs[0]))]
        pipelined = runs[0][0]["pipelined_steps"]
        table.append(
            dict(
                config=config.short(),
                patches=config.patches,
                stages=config.pipefusion,
                pipelined_steps=pipelined,
                median_s=statistics.median(seconds),
                spread_s=(min(seconds), max(seconds)),
                bubble_by_stage=[statistics.median(r["bubble"] for r in rank) for rank in runs],
                closed_form_bubble=closed_form_bubble(config, pipelined),
                latents=runs[0][0]["latents"],
            )
        )
    for row in table:
        if row["config"].endswith("async"):
            drained = next(r for r in table if r["patches"] == row["patches"] and not r["config"].endswith("async"))
            k, m, n = row["pipelined_steps"], row["patches"], row["stages"]
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

    def against_drained(row, key, spec):  # "–" on the drained rows themselves: nothing to compare with
        return format(row[key], spec) if key in row else "–"

    for r in table:
        lines.append(
            f"| {r['config']} | {r['patches']} | {r['pipelined_steps']} | {r['median_s']:.2f} | "
            f"{r['spread_s'][0]:.2f}-{r['spread_s'][1]:.2f} | {' / '.join(f'{b:.3f}' for b in r['bubble_by_stage'])} | "
            f"{r['closed_form_bubble']:.3f} | {against_drained(r, 'vs_drained', '.3f')} | "
            f"{against_drained(r, 'closed_form_vs_drained', '.3f')} | {against_drained(r, 'deviation', '.1e')} |"
        )
    return "\n".join(lines)
