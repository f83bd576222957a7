"""Tutorial 12 (skipping steps): the cache's decisions per rank, and ranks that decide alone.

decisions_table(summaries)         per step: each rank's own change, the agreed one, the decision
diverging_threshold(summaries)     a threshold between two ranks' own changes at one step
decide_alone(config, threshold)    the digits on fresh ranks whose caches do not agree: the error
steps_by_rank(summaries)           per step: what each rank did, whether they agreed, the bytes it cost
diffusers_serial(folder, cache)    diffusers' own pipeline with the same cache configuration, serially
"""

from __future__ import annotations

from ..lab.table import text_table


def decisions_table(summaries) -> str:
    """One line per step: the change each rank measured on its own tokens, the change summed over
    all ranks (what every rank decides on), the threshold and the decision."""
    summaries = sorted((s for s in summaries if s is not None), key=lambda s: s["rank"])
    first = summaries[0]["cache"]

    def fmt(value):
        return "-" if value is None else f"{value:.4f}"

    rows = []
    for step, (change, skipped) in enumerate(zip(first["changes"], first["skips"])):
        alone = [fmt(s["cache"]["local_changes"][step]) for s in summaries]
        rows.append([str(step + 1), *alone, fmt(change), f"{first['threshold']:g}", "skip" if skipped else "run"])
    header = ["step", *(f"rank {s['rank']} alone" for s in summaries), "agreed", "threshold", "decision"]
    return text_table(header, rows)


def diverging_threshold(summaries) -> tuple[int, float] | None:
    """(step, threshold) where ranks deciding alone would first disagree: the midpoint of the two
    ranks' own changes at the step where they differ most, among steps up to the first such step."""
    summaries = sorted((s for s in summaries if s is not None), key=lambda s: s["rank"])
    local = [s["cache"]["local_changes"] for s in summaries]
    for step in range(len(local[0])):
        values = [changes[step] for changes in local]
        if None in values:
            continue
        low, high = min(values), max(values)
        if high - low > 1e-4 * high:
            return step, (low + high) / 2
    return None


def _generate_alone(config, threshold: float, per_digit: int) -> list[bool]:
    from ..digits import prompt_for
    from ..models import Controls, StepCache
    from ..pipeline import load_pipeline, loading_bars_hidden

    with loading_bars_hidden():  # the deliberately wrong variant: each rank's cache decides alone
        pipe = load_pipeline(
            "digits", config, progress=False, cache=StepCache(threshold), controls=Controls(cache_agrees=False)
        )
    prompts = [prompt_for(d) for d in range(10) for _ in range(per_digit)]
    return pipe.session(prompts, seed=0).run().cache_skips


def decide_alone(config, threshold: float, *, per_digit: int = 1, collective_timeout_s: float = 5) -> str:
    """Run the digits on fresh ranks (not the Lab's) whose caches each decide from their own
    tokens; return what happened: the first rank's error line, or the skips if they agreed."""
    from ..testing import RankFailure, run_on_ranks

    try:
        skips = run_on_ranks(
            _generate_alone,
            config.world_size,
            config,
            threshold,
            per_digit,
            timeout_s=120,
            collective_timeout_s=collective_timeout_s,
        )
    except RankFailure as failure:
        lines = [line.strip() for line in str(failure).splitlines()]
        error = next((line for line in lines if "Timed out" in line or "Error:" in line), lines[0])
        return f"failed: {error.split('] ')[-1]}"
    return f"no hang: every rank skipped {skips[0]}"


def steps_by_rank(summaries, group: str = "world") -> str:
    """One line per step: each rank's decision (skip or run), whether every rank took the same, the bytes the
    decision moved out of each rank (group `group`: First-Block Cache's all-reduce) and the bytes out of each rank
    in the whole step (the byte columns list the ranks in order, separated by '/')."""
    summaries = sorted((s for s in summaries if s is not None), key=lambda s: s["rank"])
    rows = []
    for step, decisions in enumerate(zip(*(s["cache"]["skips"] for s in summaries))):
        measured = [s["comm"]["measured"][step] for s in summaries]
        rows.append(
            [
                str(step + 1),
                *("skip" if skipped else "run" for skipped in decisions),
                "yes" if len(set(decisions)) == 1 else "NO",
                " / ".join(f"{m.get(group, 0):,}" for m in measured),
                " / ".join(f"{sum(m.values()):,}" for m in measured),
            ]
        )
    header = ["step", *(f"rank {s['rank']}" for s in summaries), "agreed", f"{group} bytes", "bytes out"]
    return text_table(header, rows)


def diffusers_serial(folder, cache, prompts, **call):
    """The latents of diffusers' own image pipeline from `folder`, on this process alone, with
    `transformer.enable_cache(cache)` (None: no cache), as a user of diffusers would run it."""
    import torch
    from diffusers import DiffusionPipeline

    from ..pipeline import loading_bars_hidden

    with loading_bars_hidden():  # a notebook would show them as widgets, one per component
        pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    if cache is not None:
        pipe.transformer.enable_cache(cache)
    output = pipe(prompts, generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    return output.images
