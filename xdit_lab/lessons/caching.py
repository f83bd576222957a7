"""Tutorial 12 (skipping steps): the cache's decisions per rank, and ranks that decide alone.

decisions_table(summaries)         per step: each rank's own change, the agreed one, the decision
diverging_threshold(summaries)     a threshold between two ranks' own changes at one step
decide_alone(config, threshold)    the digits on fresh ranks whose caches do not agree: the error
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
