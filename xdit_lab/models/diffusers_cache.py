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

Under PipeFusion each stage enables the hooks on the blocks it holds (MagCache's head and tail hooks on its own
first and last: summed over the stages, what each stage's blocks added is what the whole stack added, and every
stage takes the same schedule-decided step). A stage runs its blocks once per patch past the warm-up, so the hooks'
state is kept per patch, as if each patch were its own serial run of the step (`patches`, called by the stage):

    step      stage runs            hook state (TaylorSeer's, MagCache's context; PAB's swapped on its hooks)
    warm-up   the whole image       "cond"                 one call a step, as diffusers' serial pipeline
    first     patch 0, patch 1, ..  "cond patch 0", ...    cut from "cond": its counters, its tokens' pieces
    later     patch 0, patch 1, ..  "cond patch 0", ...    each advanced once a step, caching its own tokens

Warmed up over every step the result equals diffusers' serial run; past the warm-up the attention reads stale K/V
(and a layer a hook skips leaves its K/V as last written), measured against diffusers' serial run with a bound.
`Controls(cache_state_per_patch=False)` puts every patch on patch 0's state (one counter advanced once per patch):
the deliberately wrong control. First-Block Cache decides inside the call from the first block's residual over what
the call holds, which a stage cannot (xdit_lab.StepCache decides before any patch moves), and the async schedule
runs patches of two steps at once: both are refused.

TextKVCache, First-Block Cache, FasterCache and SeaCache under PipeFusion (the last two hook the transformer
itself, outside the blocks a stage holds), compile and MagCache's calibration on several ranks are refused by name
before a weight is read (accelerations.diffusers_cache_problems says why). The model's `Controls(cache_agrees=False)`
makes each rank take First-Block Cache's decision from its own sums, and SeaCache's from its own samples:
deliberately wrong controls, which miss diffusers' result where the ranks' shares differ.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import weakref

import torch
from diffusers.hooks.hooks import CacheContext

from .. import comm
from ..accelerations import BY_DATA, SEA_CACHE_WITHOUT_SIGMA, TIMESTEP_READERS, option_problems
from ..config import CFG, DP, ParallelConfigError
from ..mesh import PIPEFUSION, SP, WORLD
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
        hooked = [(name, hook) for name, module in transformer.named_modules() for hook in _cache_hooks(module)]
        self.hooks = [hook for _, hook in hooked]  # the hooks enable_cache registered, in module order (head first)
        outside = [name for name, _ in hooked if name.split(".")[0] not in state.adapter.block_lists]
        if getattr(state.mesh.config, PIPEFUSION) > 1 and outside:
            transformer.disable_cache()
            delattr(transformer, _OWNED)
            raise ParallelConfigError(
                f"cache={self.name} under PipeFusion hooks {', '.join(outside)}, outside the blocks: a stage keeps a "
                f"hook state per patch of the tokens its blocks run, while those modules run over the whole image; "
                f"match only modules inside the blocks (cache_identifiers, skip_predict_identifiers), or no PipeFusion"
            )
        self._pab_whole = {}
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
        for hook, whole in self._pab_whole.items():  # PAB's own state back on its hook, to reset
            hook.state = whole
        self._pab_whole, self._pab_patches = {}, {}  # PAB's state of the whole image, and per (hook, patch)
        self._per_patch = False  # PipeFusion's patch steps have begun: each patch has its own state
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
        where.update({} if sigma is None else dict(sigma=sigma))
        self._context = CacheContext("cond", **where)  # a PipeFusion stage's patches take theirs from it
        with self.transformer.cache_context("cond", **where):
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

    # ---- PipeFusion: a state per patch ----------------------------------------------------------------------
    def patches(self, active: list[int], layout) -> None:
        """A PipeFusion stage is about to run its blocks over the patch set `active` (of `layout`): the hooks take
        that set's state. A whole-image set (a warm-up step) runs on the step's own ("cond"), as serially; past the
        warm-up each patch runs on its own ("cond patch 2"; PAB's, which keeps no context, swapped on its hooks),
        advanced once a step as the whole one is serially and caching that patch's tokens. At the first patch step
        each patch's state is cut from the whole one (its counters, its pieces of the cached tensors)."""
        if len(active) == len(layout.patches):
            if self._per_patch:  # its state is the patches' now, which nothing joins back
                raise NotImplementedError(
                    f"cache={self.name} under PipeFusion: a whole-image step after patch steps (a stage reset in "
                    f"the middle of a generation); start a new session"
                )
            return
        if not self._per_patch:
            self._cut_states(layout)
        (patch,) = active
        patch = patch if self.state.controls.cache_state_per_patch else 0  # the control: patch 0's for every patch
        context = dataclasses.replace(self._context, name=f"{self._context.name} patch {patch}")
        for index, hook in enumerate(self.hooks):
            if hasattr(hook, "state_manager"):
                hook.state_manager.set_context(context)
            elif self.name == "PyramidAttentionBroadcastConfig":
                hook.state = self._pab_patches[index, patch]

    def _cut_states(self, layout) -> None:
        """Every hook's state per patch, from the whole image's (or none yet, without a warm-up step): tensors
        over this rank's image tokens keep the patch's piece, the joint text's rows stay whole."""
        sp_rank, text = self.state.mesh.group_rank(SP), self.state.text_len
        sizes = [layout.chunk_len(p, sp_rank) for p in range(len(layout.patches))]
        if text and text == sum(sizes):
            raise NotImplementedError(
                f"cache={self.name} under PipeFusion: the text ({text} tokens) is as long as this rank's image, so "
                f"the hooks' cached tensors cannot be told apart; use another image size or no PipeFusion"
            )
        cut = _PatchCut(sizes, text, self.state.adapter.joined_text_last)
        managers = {id(h.state_manager): h.state_manager for h in self.hooks if hasattr(h, "state_manager")}
        for manager in managers.values():  # MagCache's hooks share one
            whole = manager._state_cache.get(self._context.name)
            for p in range(len(sizes)) if whole is not None else ():
                manager._state_cache[f"{self._context.name} patch {p}"] = cut.state(whole, p)
        for index, hook in enumerate(self.hooks if self.name == "PyramidAttentionBroadcastConfig" else ()):
            self._pab_whole[hook] = hook.state
            for p in range(len(sizes)):
                self._pab_patches[index, p] = cut.state(hook.state, p)
        self._per_patch = True

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


def _cache_hooks(module) -> list:
    """The cache hooks diffusers' enable_cache registered on `module` (none: an empty list)."""
    hooks = getattr(getattr(module, "_diffusers_hook", None), "hooks", {}).values()
    return [hook for hook in hooks if type(hook).__module__ in _CACHE_MODULES]


@dataclasses.dataclass(frozen=True)
class _PatchCut:
    """One patch's part of a hook's state from the whole image's on this rank: a tensor [B, tokens, ...] over its
    image tokens (`sizes`: this rank's tokens of each patch, patch by patch) keeps the patch's; over the joint text
    and the image (`text` tokens first, or last) the text and the patch's; any other (the text's alone) stays."""

    sizes: list
    text: int
    text_last: bool

    def state(self, whole, patch: int):
        part = copy.copy(whole)
        for name, value in vars(whole).items():
            setattr(part, name, self.value(value, patch))
        return part

    def value(self, value, patch: int):
        if isinstance(value, torch.Size):  # TaylorSeer's shapes of an output it predicts as zeros
            return torch.Size(self.value(torch.empty(value, device="meta"), patch).shape)
        if isinstance(value, torch.Tensor):
            return self.tensor(value, patch)
        if isinstance(value, dict):
            return {key: self.value(item, patch) for key, item in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(self.value(item, patch) for item in value)
        return value

    def tensor(self, tensor: torch.Tensor, patch: int) -> torch.Tensor:
        image, start = sum(self.sizes), sum(self.sizes[:patch])
        if tensor.dim() < 2 or tensor.shape[1] not in (image, image + self.text) or not image:
            return tensor
        offset = 0 if self.text_last or tensor.shape[1] == image else self.text
        piece = tensor[:, offset + start : offset + start + self.sizes[patch]]
        if tensor.shape[1] == image:
            return piece
        text = tensor[:, image:] if self.text_last else tensor[:, : self.text]
        return torch.cat([piece, text] if self.text_last else [text, piece], dim=1)


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
