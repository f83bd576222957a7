"""diffusers' own cache hooks on a parallelized transformer, with one decision for every rank.

`load_pipeline(folder, config, cache=FirstBlockCacheConfig(0.2))` (or TaylorSeerCacheConfig, MagCacheConfig,
PyramidAttentionBroadcastConfig, SeaCacheConfig, FasterCacheConfig) runs `transformer.enable_cache(config)` after
parallelize: diffusers' hooks wrap the blocks (or attention modules) whose forwards our parallel hooks already run,
so what a hook caches is what its module returned on this rank: a sequence shard's tokens, a dp or cfg share of the
batch, per shard by construction. What is ours is the decision, which every rank must take alike (a rank that skips
never calls the collectives its peers wait in):

    config                           decides from                      every rank alike because
    TaylorSeerCacheConfig            the step counted                  every rank counts the same calls
    MagCacheConfig                   precomputed ratios, the step      the same (calibrate=True is refused on several)
    PyramidAttentionBroadcastConfig  the timestep, the call counted    the session hands every rank the same timestep
    FasterCacheConfig                the timestep, the call counted    the same (is_guidance_distilled=True: its
                                     (attention outputs extrapolated)  CFG-Cache is refused on several ranks)
    SeaCacheConfig                   a spectral filter of the latents  its hook on the transformer reads the whole
                                     (FFT over frames, height, width)  input, before our forward splits batch and
                                     and the scheduler's sigma         sequence: nothing to agree, nothing moves
    FirstBlockCacheConfig            Σ|r - r_prev| / Σ|r_prev| of the  its two sums all-reduced over the world group
                                     first block's residual            (tag "cache"), as models/cache.py's StepCache

diffusers' First-Block Cache takes means over the tensor it sees; the ratio of the two means is the ratio of the
two sums, so the sums of every rank's tokens and rows, all-reduced, give the serial decision (a dp stand-in row
adds nothing). The decision method is replaced on the hook instance registered here, never in diffusers.

diffusers' serial pipelines run CFG as two calls a step, each with its own hook state ("cond", "uncond"; all
but CogVideoX's, which batches them: Recipe.cfg_in_one_call), while xdit_lab runs [uncond; cond] as one call:
TaylorSeer's and MagCache's states are elementwise or schedule-only, so one state over both branches equals two;
First-Block Cache decides from each branch's own residual and PAB's and FasterCache's counters advance per call, so
with two calls in diffusers they are refused at the step (by name).

Each session step opens the hooks' cache context ("cond", the step index, the timestep, as diffusers' pipelines
do) and records per step whether the cache skipped a computation (`skips`) and First-Block Cache's change
(`changes`; `local_changes`: what this rank's share alone gave). A cache enabled on the transformer by hand
(`transformer.enable_cache`) decides per rank: it is refused at parallelize and at the next forward.
SeaCache's distance is a mean over samples of the same latents in both of diffusers' calls, so one call over
[uncond; cond] decides as each of them; its leader and block hooks cache each rank's residual, elementwise. Its
hooks read the scheduler's sigma from the context, which the session passes where the family's diffusers pipeline
does (adapter.cache_sigma_pipelines: WanPipeline); elsewhere diffusers' own run computes every block, and SeaCache
is refused, as under tp and with FSDP2-sharded weights (diffusers' hook never skips parameter-sharded blocks; its
all-reduce on torch's default group belongs to Cosmos 3's decoder stack, a family we do not run).
FasterCache's 2-D FFT runs in its hook on the transformer, over the whole gathered output, but its CFG-Cache
(is_guidance_distilled=False) halves the whole [uncond; cond] input while its attention hooks, inside our split,
take the second half of a cfg or dp share's rows as the conditional branch: refused on several ranks.
TextKVCache, PipeFusion, compile and MagCache's calibration on several ranks are refused by name before a weight is
read (accelerations.diffusers_cache_problems says why). The model's
`Controls(cache_agrees=False)` makes each rank take First-Block Cache's decision from its own sums, and SeaCache's
from its own samples: deliberately wrong controls, which miss diffusers' result where the ranks' shares differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref

import torch

from .. import comm
from ..accelerations import BY_DATA, SEA_CACHE_WITHOUT_SIGMA, TIMESTEP_READERS, option_problems
from ..config import CFG, DP, ParallelConfigError
from ..mesh import WORLD
from ..sharding import batch_rows
from .cache import local_changes

_OWNED = "_xdit_lab_cache_config"  # the configuration enable_cache was given here, on the transformer
_CACHE_MODULES = {
    f"diffusers.hooks.{name}"
    for name in (
        "first_block_cache", "taylorseer_cache", "mag_cache", "pyramid_attention_broadcast", "sea_cache", "faster_cache"
    )
}  # fmt: skip


class DiffusersCache:
    """diffusers' hooks of `config` on a parallelized `transformer`, agreed across its ranks."""

    def __init__(self, transformer, state, config):
        problems = option_problems(state.mesh.config, state.adapter, cache=config)
        if problems:
            raise problems[0][1]("; ".join(sentence for sentence, _ in problems))
        self.settings, self.state, self.name = config, state, type(config).__name__
        self.timestep = None  # the running step's, for PAB and FasterCache
        if self.name in TIMESTEP_READERS:
            config = dataclasses.replace(config, current_timestep_callback=lambda: self.timestep)
        self._transformer = weakref.ref(transformer)  # the state lives on the transformer: no cycle through it
        transformer.enable_cache(config)
        setattr(transformer, _OWNED, transformer._cache_config)
        self.hooks = [  # the hooks enable_cache registered, in module order (the head block's first)
            hook
            for module in transformer.modules()
            for hook in getattr(getattr(module, "_diffusers_hook", None), "hooks", {}).values()
            if type(hook).__module__ in _CACHE_MODULES
        ]
        self.reset()
        self._wrap_decisions()
        if self.name == "SeaCacheConfig" and not state.controls.cache_agrees:
            root = next(h for h in self.hooks if type(h).__name__ == "SeaCacheRootHook")
            if root.raw_vision_callback is not None:
                root.raw_vision_callback = self._own_samples(root.raw_vision_callback)

    @property
    def transformer(self):
        return self._transformer()

    # ---- what the session and the views read -----------------------------------------------------------
    def reset(self) -> None:
        """A new generation: diffusers' hook states and the records start over."""
        self.transformer._reset_stateful_cache()
        self.skips: list[bool] = []
        self.changes: list[float | None] = []
        self._local_sums: list = []
        self._computed: list[bool] = []

    @property
    def local_changes(self) -> list[float | None]:
        """Per call, First-Block Cache's change from this rank's own share alone (None where none was taken)."""
        return local_changes(self.changes, self._local_sums)

    def begin(self, latents, block_residuals: bool = False) -> None:
        """The parallel forward's call: nothing to set up (diffusers' hooks hold their state; a ControlNet's
        residuals are added between blocks by the model's own forward, around the hooks, as serially)."""

    @contextlib.contextmanager
    def step(self, step_index: int, num_steps: int, t, branches_apart: bool, sigma: float | None = None):
        """One session step: the hooks' cache context open around it, then this step's decision recorded.
        `branches_apart`: the step runs CFG, which diffusers' pipeline runs as one call per branch. `sigma`: the
        scheduler's, where the family's diffusers pipeline hands it to the context (SeaCache reads it), else None."""
        if self.name == "SeaCacheConfig" and sigma is None:
            raise ParallelConfigError(f"cache=SeaCacheConfig does not run in this session: {SEA_CACHE_WITHOUT_SIGMA}")
        if branches_apart and (self.name in BY_DATA or self.name in TIMESTEP_READERS):
            raise ParallelConfigError(
                f"cache={self.name} with true CFG: diffusers' pipeline runs the two branches as two calls, "
                f"{'each deciding from its own residual' if self.name in BY_DATA else 'each advancing its counter'}, "
                f"while xdit_lab runs [uncond; cond] as one call, which would decide otherwise; run this cache "
                f"without CFG (guidance_scale 1, or no negative prompt), or use TaylorSeerCacheConfig or MagCacheConfig"
            )
        self.timestep = t
        self._computed, self._change, change = [], None, None
        expected = self._attention_skips() if self.name in TIMESTEP_READERS else None
        where = dict(step_index=step_index, num_inference_steps=num_steps, timestep=t)
        with self.transformer.cache_context("cond", **where, **({} if sigma is None else dict(sigma=sigma))):
            yield
            if self.name == "SeaCacheConfig":  # its leader's state counts the reuses in a row (0: the blocks ran)
                leader = next(h for h in self.hooks if type(h).__name__ == "SeaCacheLeaderBlockHook")
                self._computed.append(leader.state_manager.get_state().consecutive_cached == 0)
            if self.name == "MagCacheConfig":  # its head hook's decision, kept in the shared state
                head = next(h for h in self.hooks if type(h).__name__ == "MagCacheHeadHook")
                self._computed.append(head.state_manager.get_state().should_compute)
        if self.name in BY_DATA:
            change = self._change
        skipped = expected if expected is not None else not all(self._computed)
        self.skips.append(bool(skipped))
        self.changes.append(change)

    def remove(self) -> None:
        """diffusers' disable_cache: the hooks and their states go."""
        self.transformer.disable_cache()
        if hasattr(self.transformer, _OWNED):
            delattr(self.transformer, _OWNED)

    # ---- the decisions ---------------------------------------------------------------------------------
    def _wrap_decisions(self) -> None:
        for hook in self.hooks:
            if self.name in BY_DATA and hasattr(hook, "_should_compute_remaining_blocks"):
                hook._should_compute_remaining_blocks = self._first_block_decision(hook)
            elif self.name == "TaylorSeerCacheConfig":
                hook._measure_should_compute = self._recorded(hook._measure_should_compute)

    def _recorded(self, measure):
        def recorded():
            should_compute, state = measure()
            self._computed.append(should_compute)
            return should_compute, state

        return recorded

    def _first_block_decision(self, hook):
        """diffusers' FBCHeadBlockHook._should_compute_remaining_blocks from the whole batch and sequence: its
        means' ratio as the ratio of sums all-reduced over every rank (two float32, tag "cache")."""
        state, threshold = self.state, hook.threshold

        def decide(residual: torch.Tensor) -> bool:
            previous = hook.state_manager.get_state().head_block_residual
            self._change = None
            if previous is None:
                self._computed.append(True)
                return True
            sums = torch.stack([(residual - previous).abs().sum(), previous.abs().sum()]).float()
            if state.stand_in:  # a dp stand-in row is dropped after the forward: it is no sample
                sums = torch.zeros_like(sums)
            self._local_sums.append(sums.clone())
            if state.controls.cache_agrees:
                comm.all_reduce(sums, state.mesh, WORLD, tag="cache")
            differing, total = sums.tolist()  # the one host sync of a step, as in diffusers
            self._change = differing / total if total > 0 else math.inf
            run = self._change > threshold
            self._computed.append(run)
            return run

        return decide

    def _own_samples(self, raw_vision):
        """CONTROL (Controls(cache_agrees=False)): SeaCache's indicator from this rank's samples alone (its cfg
        and dp rows), as if its hook ran after the batch was split: the ranks' distances, and so decisions, differ."""
        mesh, config = self.state.mesh, self.state.mesh.config

        def own(module, args, kwargs):
            latents = raw_vision(module, args, kwargs)
            if not latents:
                return latents
            start, stop, _ = batch_rows(len(latents), config.cfg, config.dp, mesh.group_rank(CFG), mesh.group_rank(DP))
            return latents[start:stop]

        return own

    def _attention_skips(self) -> bool:
        """Whether PAB or FasterCache reuses an attention output this step: diffusers' own predicate on each
        attention hook's state before the call (PyramidAttentionBroadcastHook.new_forward, FasterCacheBlockHook's
        with is_guidance_distilled, the one FasterCache runs under a ParallelConfig), the same on every rank."""
        for hook in self.hooks:
            if not hasattr(hook, "timestep_skip_range"):  # FasterCache's hook on the transformer: it counts calls
                continue
            low, high = hook.timestep_skip_range
            s = hook.state
            if not low < self.timestep < high or (s.iteration % hook.block_skip_range == 0 and s.iteration > 0):
                continue
            if self.name == "FasterCacheConfig" or (s.cache is not None and s.iteration != 0):
                return True
        return False


def refuse_foreign_cache(transformer) -> None:
    """Raise where diffusers' cache was enabled on a parallelized transformer by hand (transformer.enable_cache):
    its hooks would decide on each rank alone. Through xdit_lab (cache=, pipe.enable_cache) it is agreed."""
    enabled = getattr(transformer, "_cache_config", None)
    if enabled is not None and enabled is not getattr(transformer, _OWNED, None):
        raise ParallelConfigError(
            f"{type(transformer).__name__} has diffusers' {type(enabled).__name__} enabled by hand "
            f"(transformer.enable_cache): under a ParallelConfig its hooks would decide on each rank alone, from "
            f"that rank's tokens; call transformer.disable_cache() and pass the configuration to load_pipeline's "
            f"cache= or pipe.enable_cache(config), which run the same hooks with one decision for every rank"
        )
