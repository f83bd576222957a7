"""The accelerations a user asks for, and what they refuse under a configuration, for a family: a StepCache's
settings (its runtime, the hooks that skip blocks, is models/cache.py), torch.compile's backend, and the rules:
compile with PipeFusion, a StepCache on a family that has none yet or under the async PipeFusion
schedule, a convolution over token rows (Sana's) under PipeFusion with ulysses or ring within a stage, and a cache
object that is no StepCache (diffusers' cache configurations are not run here yet: each is
refused by name, never run as something else).

    option_problems(config, adapter, cache=StepCache(0.1), compile=True)   # [(sentence, exception type), ...]

One set of rules with two askers: LoadOptions.problems() says them before a weight is read, and parallelize raises
them for a model built by hand. They sit low in the house so that both (and the planner, through LoadOptions) can
ask them without the planner reaching up into the parallel core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import PIPEFUSION, ParallelConfigError

METHODS = ("first_block",)


@dataclass(frozen=True)
class StepCache:
    """Skip the transformer's blocks after the first block when its residual changed by at most
    `threshold` (relative, summed over the whole batch on every rank) since the last full step.

    Pass it as `load_pipeline(folder, config, cache=StepCache(0.1))`, `lab.load(..., cache=...)`
    or `xdit-lab run --cache-threshold 0.1`. threshold 0 never skips."""

    threshold: float = 0.1
    method: str = "first_block"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"StepCache method {self.method!r} is not implemented; methods: {', '.join(METHODS)}")
        if not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold) or self.threshold < 0:
            raise ValueError(
                f"StepCache threshold must be a finite number >= 0 (0 never skips), got {self.threshold!r}"
            )


def option_problems(config, adapter, *, cache=None, compile=False) -> list[tuple[str, type[Exception]]]:
    """What parallelize refuses of its cache and compile options for a model of `adapter`'s family under `config`,
    as (sentence, the exception it raises them as): an unknown compile backend, compile's own rules
    (compile_problems), a family that has no StepCache yet, a StepCache under the async schedule. LoadOptions.problems
    asks the same before a weight is read."""
    found = []
    if cache is not None and not isinstance(cache, StepCache):
        found.append((_unknown_cache(cache), TypeError))
        cache = None  # the rules below are a StepCache's
    if compile:
        try:
            compile_backend(compile)
        except ValueError as error:
            found.append((str(error), ValueError))
        found += [(sentence, ParallelConfigError) for sentence in compile_problems(config)]
    if adapter.row_convolution is not None and getattr(config, PIPEFUSION) > 1 and config.sp_degree > 1:
        found.append(
            (
                f"{adapter.family} under PipeFusion holds whole patches on each stage's rank (ulysses = ring = 1 "
                f"within a stage): its convolution over token rows would need halo rows between the pieces that "
                f"every sequence-parallel rank holds of each patch; use pipefusion with cfg and dp, or ulysses and "
                f"ring without pipefusion",
                ParallelConfigError,
            )
        )
    if cache is not None and adapter.step_cache_refused:
        found.append(
            (f"StepCache is not offered on {adapter.family} yet: {adapter.step_cache_refused}", ParallelConfigError)
        )
    if cache is not None and config.pipefusion_schedule == "async":
        found.append(
            (
                "a StepCache does not run under pipefusion_schedule='async': it decides for a whole step before "
                "any patch moves, while the async schedule has two steps in flight; use the drained schedule",
                ParallelConfigError,
            )
        )
    return found


def _unknown_cache(cache) -> str:
    kind = f"{type(cache).__module__.split('.')[0]}'s {type(cache).__name__}"
    return (
        f"cache={kind} is not a cache xdit_lab runs: cache= takes xdit_lab.StepCache(threshold) (First-Block Cache, "
        f"one decision for the whole batch taken by every rank together); diffusers' own cache configurations are "
        f"not run under a ParallelConfig yet, and running one as a StepCache would give another image than "
        f"diffusers' without a word"
    )


def compile_problems(config) -> list[str]:
    """Why compile=True cannot take this configuration whole, as sentences. A StepCache it takes: the decision's
    host sync breaks the graph there, and each decision's graphs are traced once (models/cache.py)."""
    found = []
    if getattr(config, PIPEFUSION) > 1:
        found.append(
            "compile=True does not take PipeFusion: a stage runs its blocks once per patch, reading and writing "
            "stale K/V buffers in place between sends, which torch.compile cannot trace as one graph; "
            "compile ulysses, ring, cfg and dp, or run PipeFusion eagerly"
        )
    return found


def compile_backend(compile: bool | str) -> str:
    """torch.compile's backend that `compile` asks for: its default for True, else the one named."""
    if compile is True:
        return "inductor"
    if not isinstance(compile, str) or compile not in torch._dynamo.list_backends(exclude_tags=()):
        shown = [*torch._dynamo.list_backends(), "aot_eager", "eager"]  # the debug ones a user may want too
        raise ValueError(
            f"compile={compile!r}: give True (torch.compile's default backend, inductor) or the name of one of "
            f"torch.compile's backends: {', '.join(shown)}"
        )
    return compile
