"""The accelerations a user asks for, and what they refuse under a configuration, for a family: a StepCache's
settings (its runtime, the hooks that skip blocks, is models/cache.py), torch.compile's backend, and the rules:
compile with PipeFusion, a StepCache on a family that has none yet or under the async PipeFusion
schedule, a convolution over token rows (Sana's) under PipeFusion with ulysses or ring within a stage, diffusers'
own cache configurations (their runtime, diffusers' hooks with one decision for every rank, is
models/diffusers_cache.py) where they cannot be agreed, and any other cache object, refused by name, never run as
something else.

    option_problems(config, adapter, cache=StepCache(0.1), compile=True)   # [(sentence, exception type), ...]

One set of rules with two askers: LoadOptions.problems() says them before a weight is read, and parallelize raises
them for a model built by hand. They sit low in the house so that both (and the planner, through LoadOptions) can
ask them without the planner reaching up into the parallel core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import PIPEFUSION, TP, ParallelConfigError

METHODS = ("first_block", "teacache", "dbcache")


@dataclass(frozen=True)
class StepCache:
    """Skip transformer blocks at steps where the model's input barely changed, one decision for the whole
    batch taken by every rank together (sums all-reduced). Three methods:

    first_block  (First-Block Cache) skip the blocks after the first when the first block's residual changed
                 by at most `threshold` (relative) since the last full step.
    teacache     (TeaCache, Liu et al.) the relative L1 change of the first block's timestep-modulated input
                 since the previous step, rescaled by the polynomial `coefficients` (highest power first, as
                 numpy.poly1d; default identity (1, 0); the paper publishes them per model), accumulated; while
                 the sum stays below `threshold` every block is skipped and what the whole stack added at the
                 last full step is added instead; else all run and the sum restarts. The first and the last step
                 of a session always run. On the families whose adapter says how to compute the first
                 block's modulated input (`teacache`: Flux, Flux.2, Wan, HunyuanVideo,
                 Qwen-Image, CogVideoX, PixArt).
    dbcache      (DBCache, cache-dit's Dual Block Cache) the first `front` blocks always run, and the relative
                 change of what they added since the last full step decides as First-Block Cache's first block
                 does; a skipped step passes the middle blocks over and adds what they added at the last full
                 step (with `taylor_order` k > 0, a TaylorSeer's prediction of it: a Taylor expansion of order k
                 from finite differences over the last full steps); the last `back` blocks always run.
                 front=1, back=0, taylor_order=0 is First-Block Cache. Sequence shards only (models/dbcache.py).

    Pass it as `load_pipeline(folder, config, cache=StepCache(0.1))`, `lab.load(..., cache=...)`
    or `xdit-lab run --cache stepcache:threshold=0.1`. threshold 0 never skips (teacache: with a rescale that is never
    negative, as the identity)."""

    threshold: float = 0.1
    method: str = "first_block"
    coefficients: tuple[float, ...] | None = None
    front: int | None = None
    back: int | None = None
    taylor_order: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"StepCache method {self.method!r} is not implemented; methods: {', '.join(METHODS)}")
        if self.method == "teacache":
            coefficients = (1.0, 0.0) if self.coefficients is None else tuple(float(c) for c in self.coefficients)
            if not coefficients or not all(math.isfinite(c) for c in coefficients):
                raise ValueError(f"StepCache coefficients must be finite numbers, got {self.coefficients!r}")
            object.__setattr__(self, "coefficients", coefficients)
        elif self.coefficients is not None:
            raise ValueError(f"StepCache coefficients are TeaCache's rescale; method {self.method!r} takes none")
        self._dbcache_fields()
        if not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold) or self.threshold < 0:
            raise ValueError(
                f"StepCache threshold must be a finite number >= 0 (0 never skips), got {self.threshold!r}"
            )

    def _dbcache_fields(self) -> None:
        """DBCache's block counts and calibrator: defaults front=1, back=0, taylor_order=0 (First-Block Cache)."""
        fields = dict(front=(self.front, 1, 1), back=(self.back, 0, 0), taylor_order=(self.taylor_order, 0, 0))
        if self.method != "dbcache":
            given = [name for name, (value, _, _) in fields.items() if value is not None]
            if given:
                raise ValueError(f"StepCache {', '.join(given)} are DBCache's; method {self.method!r} takes none")
            return
        for name, (value, default, least) in fields.items():
            value = default if value is None else value
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"StepCache(method='dbcache') {name} must be a whole number >= {least}, got {value!r}")
            object.__setattr__(self, name, value)

    def record(self) -> dict:
        """Its fields as a run's records keep them (JSON values): threshold, method and the fields its method takes."""
        extra = dict(coefficients=self.coefficients, front=self.front, back=self.back, taylor_order=self.taylor_order)
        return dict(threshold=self.threshold, method=self.method) | {
            k: list(v) if isinstance(v, tuple) else v for k, v in extra.items() if v is not None
        }

    def __repr__(self) -> str:  # as one writes it: only the fields its method takes are shown
        extra = "" if self.coefficients is None else f", coefficients={self.coefficients!r}"
        if self.method == "dbcache":
            extra = f", front={self.front!r}, back={self.back!r}, taylor_order={self.taylor_order!r}"
        return f"StepCache(threshold={self.threshold!r}, method={self.method!r}{extra})"


def option_problems(config, adapter, *, cache=None, compile=False) -> list[tuple[str, type[Exception]]]:
    """What parallelize refuses of its cache and compile options for a model of `adapter`'s family under `config`,
    as (sentence, the exception it raises them as): an unknown compile backend, compile's own rules
    (compile_problems), a family that has no StepCache yet, a StepCache under the async schedule, a cache under tp
    and PipeFusion together. LoadOptions.problems
    asks the same before a weight is read."""
    found = []
    if cache is not None and config.tp > 1 and getattr(config, PIPEFUSION) > 1:
        # a skipped step runs the model's first block (StepCache) or none on a stage split over tp, which neither
        # the stage's stale K/V nor tp's closed form has been checked on yet
        found.append(
            (
                f"a cache ({_named(cache)}) is not composed with tp {config.tp} under PipeFusion (pipefusion "
                f"{config.pipefusion}) yet; use it with tp and ulysses, ring, cfg or dp, or with PipeFusion and tp 1",
                ParallelConfigError,
            )
        )
    if is_diffusers_cache(cache):
        found += [(sentence, ParallelConfigError) for sentence in diffusers_cache_problems(config, adapter, cache)]
        if compile:
            found.append((f"compile=True does not take {_named(cache)}: {DECIDES_IN_PYTHON}", ParallelConfigError))
        compile, cache = False, None  # the rules below are a StepCache's and compile's with one
    elif cache is not None and not isinstance(cache, StepCache):
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
    if cache is not None and cache.method == "teacache":
        found += [(sentence, ParallelConfigError) for sentence in _teacache_problems(config, adapter, compile)]
    if cache is not None and cache.method == "dbcache":
        found += [(sentence, ParallelConfigError) for sentence in _dbcache_problems(config, compile)]
    if cache is not None and config.pipefusion_schedule == "async":
        found.append(
            (
                "a StepCache does not run under pipefusion_schedule='async': it decides for a whole step before "
                "any patch moves, while the async schedule has two steps in flight; use the drained schedule",
                ParallelConfigError,
            )
        )
    return found


def _teacache_problems(config, adapter, compile) -> list[str]:
    """Why StepCache(method="teacache") does not run here yet, as sentences (each says what runs instead)."""
    found = []
    if not adapter.teacache:
        found.append(
            f"StepCache(method='teacache') is not offered on {adapter.family} yet: its rule reads the first block's "
            f"timestep-modulated input, which xdit_lab does not know how to compute for {adapter.family}'s first "
            f"block (its adapter's `teacache` is None); use StepCache(threshold) (First-Block Cache) there"
        )
    if getattr(config, PIPEFUSION) > 1:
        found.append(
            "StepCache(method='teacache') does not run under PipeFusion yet: it skips every block, the first stage's "
            "too, so the stale K/V buffers would not be refreshed at a skipped step; use ulysses, ring, cfg or dp, "
            "or StepCache(threshold) (First-Block Cache) under PipeFusion"
        )
    if config.tp > 1:
        found.append(
            "StepCache(method='teacache') does not run under tensor parallelism yet: it reads the first block's "
            "modulation, whose layers tp splits; use ulysses, ring, cfg or dp"
        )
    if compile:
        found.append(
            "compile=True does not take StepCache(method='teacache') yet: its decision's graph breaks are not "
            "counted as First-Block Cache's are; use compile=False with it, or StepCache(threshold) with compile"
        )
    return found


def _dbcache_problems(config, compile) -> list[str]:
    """Why StepCache(method="dbcache") does not run here yet, as sentences (each says what runs instead)."""
    found = []
    if getattr(config, PIPEFUSION) > 1:
        found.append(
            "StepCache(method='dbcache') does not run under PipeFusion yet: its front and back blocks would sit on "
            "different stages, and the decision would wait for the front's residual over every patch; use ulysses, "
            "ring, cfg or dp, or StepCache(threshold) (First-Block Cache) under PipeFusion"
        )
    if config.tp > 1:
        found.append(
            "StepCache(method='dbcache') does not run under tensor parallelism yet: the closed form of tp's traffic "
            "at a skipped step counts the first block's layers alone, not the back blocks'; use ulysses, ring, cfg "
            "or dp"
        )
    if compile:
        found.append(
            "compile=True does not take StepCache(method='dbcache') yet: its decision's graph breaks are not "
            "counted as First-Block Cache's are; use compile=False with it, or StepCache(threshold) with compile"
        )
    return found


def _unknown_cache(cache) -> str:
    return (
        f"cache={_named(cache)} is not a cache xdit_lab runs: cache= takes xdit_lab.StepCache(threshold) (First-Block "
        f"Cache, one decision for the whole batch taken by every rank together) or one of diffusers' cache "
        f"configurations ({', '.join(DIFFUSERS_CACHES)}), run by diffusers' own hooks with one decision for every rank"
    )


def _named(cache) -> str:
    owner = type(cache).__module__.split(".")[0]
    return f"{owner}{chr(39) if owner.endswith('s') else chr(39) + 's'} {type(cache).__name__}"


# diffusers' cache configurations (diffusers.hooks), by how every rank comes to the same decision
# (models/diffusers_cache.py runs them): from the schedule alone (the step counted, the timestep, MagCache's
# precomputed ratios), from the transformer's whole input (SeaCache's spectral indicator of the latents, which its
# hook on the transformer reads before the batch and the sequence are split: the same on every rank), or from the
# data (First-Block Cache's relative change: its two sums all-reduced over the configuration's ranks); the rest are
# refused under parallelism, each for its own reason.
# the ones PipeFusion takes, with a hook state per patch (models/diffusers_cache.py); FasterCache hooks the transformer
PER_PATCH = ("TaylorSeerCacheConfig", "MagCacheConfig", "PyramidAttentionBroadcastConfig")
BY_SCHEDULE = (*PER_PATCH, "FasterCacheConfig")
BY_INPUT = ("SeaCacheConfig",)
BY_DATA = ("FirstBlockCacheConfig",)
DECIDED_ALIKE = (*BY_SCHEDULE, *BY_INPUT)  # every rank decides alike with no collective: nothing moves for it
REFUSED = dict(
    TextKVCacheConfig="it caches NucleusMoE-Image's text keys and values, a family xdit_lab does not run",
)
DIFFUSERS_CACHES = (*BY_DATA, *BY_SCHEDULE, *BY_INPUT)
# those whose hooks read the running step's timestep from a callback (models/diffusers_cache.py gives them one)
TIMESTEP_READERS = ("PyramidAttentionBroadcastConfig", "FasterCacheConfig")
DECIDES_IN_PYTHON = "whether a step, block or attention runs is decided in Python by its hooks; run the cache eagerly"


def is_diffusers_cache(cache) -> bool:
    """One of diffusers' cache configurations (diffusers.hooks.*CacheConfig, PyramidAttentionBroadcastConfig)."""
    return type(cache).__module__.startswith("diffusers.") and type(cache).__name__ in (*DIFFUSERS_CACHES, *REFUSED)


def diffusers_cache_problems(config, adapter, cache) -> list[str]:
    """Why diffusers' cache configuration `cache` cannot run agreed on `adapter`'s family under `config`, as
    sentences: a transformer without diffusers' CacheMixin (whose serial pipeline runs no cache: nothing to equal),
    a configuration that cannot be agreed, First-Block Cache under PipeFusion (the others run with a state per
    patch) and the async schedule, MagCache's calibration on several ranks."""
    import diffusers
    from diffusers.models.cache_utils import CacheMixin

    name, found = type(cache).__name__, []
    if not issubclass(getattr(diffusers, adapter.class_name), CacheMixin):
        found.append(
            f"cache={name}: {adapter.family}'s {adapter.class_name} takes no diffusers cache (it has no CacheMixin, "
            f"so diffusers' own pipeline runs none to compare with); use xdit_lab.StepCache(threshold) or no cache"
        )
    elif name in REFUSED:
        found.append(
            f"cache={name} is not run under a ParallelConfig: {REFUSED[name]}; use one of {', '.join(DIFFUSERS_CACHES)}"
        )
    elif name in ("FirstBlockCacheConfig", "MagCacheConfig") and adapter.block_returns:
        # their head and tail hooks look each block up in diffusers' TransformerBlockRegistry
        found.append(
            f"cache={name} does not run on {adapter.family}: diffusers' TransformerBlockRegistry does not list its "
            f"blocks ({', '.join(adapter.block_returns)}), which the hooks look up, so diffusers' own pipeline raises "
            f"on it; use TaylorSeerCacheConfig or PyramidAttentionBroadcastConfig"
        )
    elif name in adapter.diffusers_cache_refused:  # diffusers' own serial run raises: nothing to equal
        found.append(f"cache={name} does not run on {adapter.family}: {adapter.diffusers_cache_refused[name]}")
    elif name == "SeaCacheConfig" and not adapter.cache_sigma_pipelines:
        found.append(f"cache=SeaCacheConfig does not run on {adapter.family}: {SEA_CACHE_WITHOUT_SIGMA}")
    if getattr(config, PIPEFUSION) > 1 and name in ("FasterCacheConfig", "SeaCacheConfig"):
        found.append(
            f"cache={name} does not run under PipeFusion: it hooks the transformer itself, outside the blocks a "
            f"stage holds, over the whole image and every block, while a stage runs its own blocks once per patch; "
            f"use TaylorSeerCacheConfig, MagCacheConfig or PyramidAttentionBroadcastConfig, or "
            f"xdit_lab.StepCache(threshold)"
        )
    elif getattr(config, PIPEFUSION) > 1 and name in BY_DATA:
        found.append(
            f"cache={name} does not run under PipeFusion: its hooks decide inside each call from the first block's "
            f"residual over what that call holds, while a stage runs its blocks once per patch, so stage 0 would "
            f"decide per patch and the later stages, which hold no first block, could not; use "
            f"xdit_lab.StepCache(threshold), which runs the first block over every patch before any moves and agrees "
            f"on one decision, or TaylorSeerCacheConfig, MagCacheConfig or PyramidAttentionBroadcastConfig"
        )
    elif getattr(config, PIPEFUSION) > 1 and getattr(cache, "use_lite_mode", False):
        found.append(
            f"cache={name}(use_lite_mode=True) does not run under PipeFusion: it predicts proj_out, which a stage "
            f"runs over the whole image while its hook state is kept per patch; use TaylorSeer's default patterns "
            f"(the blocks' attention)"
        )
    if getattr(config, PIPEFUSION) > 1 and name in PER_PATCH and config.pipefusion_schedule == "async":
        found.append(
            f"cache={name} does not run under pipefusion_schedule='async': its hooks' state per patch advances with "
            f"the session's step, while the async schedule has two steps in flight on the stages; use the drained "
            f"schedule"
        )
    if name == "SeaCacheConfig" and getattr(config, TP) > 1:
        found.append(f"cache=SeaCacheConfig does not run under tp: {SEA_CACHE_SPLIT_WEIGHTS}")
    if name == "MagCacheConfig" and cache.calibrate and config.world_size > 1:
        found.append(
            "MagCacheConfig(calibrate=True) measures its ratios from the residuals a rank holds, a shard or a share "
            "of the batch under a ParallelConfig; calibrate on one rank and pass the ratios it prints as mag_ratios"
        )
    if name in TIMESTEP_READERS and cache.current_timestep_callback is not None:
        found.append(
            f"{name}: leave current_timestep_callback None: xdit_lab gives its hooks the timestep of the step its "
            f"session runs (a callback reading a diffusers pipeline's current_timestep would read a pipeline that "
            f"never runs here)"
        )
    if name == "FasterCacheConfig" and not cache.is_guidance_distilled and config.world_size > 1:
        found.append(
            "FasterCacheConfig(is_guidance_distilled=False) runs its CFG-Cache: its hook on the transformer cuts the "
            "input batch, taken as [uncond; cond], in half at some steps, and its attention hooks keep the second half "
            "of the rows they see as the conditional branch and skip where a call's rows are fewer than the first "
            "call's; under cfg or dp a rank's rows are its share of the batch, not [uncond; cond], and under ulysses "
            "or ring the halved calls are not measured; pass is_guidance_distilled=True (its attention cache alone, "
            "decided from the schedule) or run it on one rank"
        )
    return found


SEA_CACHE_WITHOUT_SIGMA = (
    "its diffusers pipeline opens each call's cache context without the scheduler's sigma, which SeaCache's "
    "spectral filter needs, so diffusers' own run computes every block (fail-open) and there is no cache to equal; "
    "use TaylorSeerCacheConfig, MagCacheConfig or PyramidAttentionBroadcastConfig"
)
SEA_CACHE_SPLIT_WEIGHTS = (
    "diffusers' SeaCache hook runs every block of a transformer whose block weights are DTensors or FSDP-managed "
    "(it will not skip parameter-sharded blocks), while its serial run skips; run SeaCache on ulysses, ring, cfg "
    "and dp with whole weights"
)


def sea_cache_load_problems(cache, adapter, pipeline_class: str, sharded: bool) -> list[str]:
    """Why SeaCache cannot equal diffusers' run of `pipeline_class` as loaded (LoadOptions.problems asks before a
    weight is read): a pipeline of a family that passes sigma which does not (Wan's image to video), weights
    sharded with FSDP2 (shard_weights=True)."""
    if type(cache).__name__ != "SeaCacheConfig" or not adapter.cache_sigma_pipelines:
        return []  # not SeaCache, or refused for the whole family by diffusers_cache_problems
    found = []
    if pipeline_class not in adapter.cache_sigma_pipelines:
        found.append(f"cache=SeaCacheConfig does not run with {pipeline_class}: {SEA_CACHE_WITHOUT_SIGMA}")
    if sharded:
        found.append(f"cache=SeaCacheConfig does not take shard_weights=True: {SEA_CACHE_SPLIT_WEIGHTS}")
    return found


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
