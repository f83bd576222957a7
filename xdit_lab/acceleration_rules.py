"""What an acceleration refuses under a configuration, for a family: torch.compile (an unknown backend, PipeFusion, a
StepCache) and a StepCache (a family that has none yet, the async PipeFusion schedule).

    option_problems(config, adapter, cache=StepCache(0.1), compile=True)   # [(sentence, exception type), ...]

One set of rules with two askers: LoadOptions.problems() says them before a weight is read, and parallelize raises
them for a model built by hand. They sit low in the house so that both (and the planner, through LoadOptions) can
ask them without the planner reaching up into the parallel core.
"""

from __future__ import annotations

import torch

from .config import PIPEFUSION, ParallelConfigError


def option_problems(config, adapter, *, cache=None, compile=False) -> list[tuple[str, type[Exception]]]:
    """What parallelize refuses of its cache and compile options for a model of `adapter`'s family under `config`,
    as (sentence, the exception it raises them as): an unknown compile backend, compile's own rules
    (compile_problems), a family that has no StepCache yet, a StepCache under the async schedule. LoadOptions.problems
    asks the same before a weight is read."""
    found = []
    if compile:
        try:
            compile_backend(compile)
        except ValueError as error:
            found.append((str(error), ValueError))
        found += [(sentence, ParallelConfigError) for sentence in compile_problems(config, cache)]
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


def compile_problems(config, cache=None) -> list[str]:
    """Why compile=True cannot take this configuration whole, as sentences."""
    found = []
    if getattr(config, PIPEFUSION) > 1:
        found.append(
            "compile=True does not take PipeFusion: a stage runs its blocks once per patch, reading and writing "
            "stale K/V buffers in place between sends, which torch.compile cannot trace as one graph; "
            "compile ulysses, ring, cfg and dp, or run PipeFusion eagerly"
        )
    if cache is not None:
        found.append(
            "compile=True does not take a StepCache: whether a step runs its blocks is decided from this step's "
            "values, which splits the graph; run the cache eagerly"
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
