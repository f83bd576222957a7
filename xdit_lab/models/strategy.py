"""The token strategy's interface: what the hooks, the parallel forward, the session and the cache ask of
the strategy that decides which tokens a rank holds (sequence.py's SequenceShards, pipefusion/'s
PipeFusionStage), and what one step is handed.

    session.step() ──StepContext──> strategy.run_step ──> transformer(...): the parallel forward
                                                            ├─ strategy.forward
                                                            └─ the hooks: shard, attend, gather, ...

A strategy is told nothing about the session that drives it: a step gets a StepContext (the diffusers
pipeline, the prepared request, the recipe, which step of how many), built by the session for that step.
Whatever the Lab, the lessons or the planner want to know of a strategy comes from one call,
`strategy.report(grid, rows)`, as a frozen StrategyReport. Deliberately wrong variants (Controls) are
passed to one model's parallelize and read from its parallel state, never set on a strategy's class.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from ..attention.stale import StaleKV


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What one denoising step needs, built by the session for that step: the diffusers pipeline, the
    prepared request (its latents and conditioning change in place), the family's recipe, and the step's
    index among `num_steps`."""

    pipeline: Any  # the diffusers pipeline (its transformer, scheduler)
    prepared: Any  # families.Prepared
    recipe: Any  # families.recipe.Recipe
    step_index: int
    num_steps: int

    @property
    def last(self) -> bool:
        return self.step_index + 1 == self.num_steps


class TokenStrategy(Protocol):
    """What a token strategy answers: the hooks, the parallel forward, the session's step and the cache
    call the members below at run time, and everything else asks `report`."""

    # what the hooks install (models/hooks.py): token hooks, the attention, the text where the blocks take it
    splits_tokens: bool
    takes_attention: bool
    text_shard_at: str | None  # "input", "block", "joined" (the adapter's place), or None: the text stays whole
    # what a StepCache asks (models/cache.py): decide before the blocks run (over the whole image) or after
    decides_before_blocks: bool

    def forward(self, run, bound):
        """One call of the parallel forward: `run()` runs the model's own forward on `bound`'s arguments."""

    def run_step(self, context: StepContext, t) -> None:
        """One denoising step at timestep `t`."""

    def reset(self) -> None:
        """A new generation: nothing kept from the last one."""

    # ---- the hooks ------------------------------------------------------------------------------------
    def shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of the patch embedding's output."""

    def shard_rotary(self, tables):
        """This rank's rows of the rotary tables."""

    def shard_text(self, text: torch.Tensor) -> torch.Tensor:
        """This rank's share of the joint text states [B, T, C], where `text_shard_at` says."""

    def keep_tokens(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's entries of a tensor with one per image token on `dim`."""

    def keep_prefix(self, count: int) -> int:
        """How many of this rank's image tokens are among the sequence's first `count`."""

    def attend(self, kind, name, query, key, value, scale, text, image_len, text_mask=None) -> torch.Tensor:
        """Attention of this rank's queries over the whole sequence, for one attention module."""

    def linear_sums(self, name: str, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The whole image's linear-attention sums [B, H, D+1, D] from this rank's keys and values, for the
        linear-attention module `name`."""

    def token_rows(self, height: int, width: int) -> int:
        """The token rows this rank holds of a height × width grid (a convolution over rows: whole rows)."""

    def halo_sizes(self, reach: int) -> tuple[int, int]:
        """Rows `halo` adds above and below this rank's rows."""

    def halo(self, name: str, x: torch.Tensor, reach: int) -> torch.Tensor:
        """x[B, C, h, W], this rank's rows, with the neighbouring rows the convolving module `name` reads
        around them."""

    def gather(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole image's tokens, before unpatchify."""

    def token_patches(self, tokens: int) -> list[tuple[int, int]]:
        """(patch, tokens) of this rank's tokens in the running forward."""

    # ---- what the views and the planner ask, in one record ---------------------------------------------
    def report(self, grid: tuple[int, int] | None = None, rows: int | None = None, appended=()) -> StrategyReport:
        """This strategy now, its tokens for a `grid` of tokens (with the `appended` grids of images after it),
        and what it would keep for `rows` batch rows."""


@dataclasses.dataclass(frozen=True)
class Controls:
    """Deliberately wrong variants that a measured bound must catch, passed to one model
    (`parallelize(..., controls=Controls(...))`, `load_pipeline(..., controls=...)`) and kept on its
    parallel state, where its strategy reads them: a control given to one model changes no other.

    shards_text             False: sequence shards keep the joint text whole on every rank, as before
                            it was split (more rows per rank; tests/test_models.py counts them)
    buffer_type             the class of each layer's stale K/V buffer on a PipeFusion stage
                            (xdit_lab.lessons.controls: zeros, or a read before the write)
    drops_returned_latents  True: stage 0 of the async schedule receives the latents the last stage sends
                            back but keeps its own, a step behind: the mistake the return path prevents
    rebases_block_residuals False: a ControlNet's residuals reach a stage's blocks as the whole model
                            indexes them: the mistake rebasing prevents
    cache_agrees            False: a StepCache's ranks each decide from their own tokens' sums, not the
                            whole batch's (they diverge, and a collective times out): models/cache.py; diffusers'
                            SeaCache's each from their own samples (models/diffusers_cache.py)
    cache_keeps_block_residuals  True: a StepCache caches a ControlNet's residuals added between its blocks with what
                            the blocks added, so a skipped step adds the full step's as well as its own: the
                            mistake taking them out prevents (models/cache.py)
    cache_state_per_patch   False: diffusers' cache hooks on a PipeFusion stage keep one state for every patch
                            (one counter advanced once per patch, one cached tensor overwritten by each), not
                            one per patch: the mistake a state per patch prevents (models/diffusers_cache.py)
    exchanges_halo          False: a convolution over token rows (Sana's feed-forward) convolves each rank's band
                            alone, zeros beyond its edges: the mistake the halo rows prevent (models/row_halo.py)
    merges_whole_queries    False: a "whole_queries" attention (LTX-2's audio asking the video) attends to this
                            rank's image keys alone, its partial output unmerged: the mistake the LSE merge prevents
    wrong_comm_scales       True: with ParallelConfig.comm_dtype, each row of float8 on the wire is unpacked
                            with the scale of the row before it (attention/wire.py): the mistake a scale per
                            block must not make (tests/test_fp8_comm.py's bound catches it)
    """

    shards_text: bool = True
    buffer_type: type = StaleKV
    drops_returned_latents: bool = False
    rebases_block_residuals: bool = True
    cache_agrees: bool = True
    cache_keeps_block_residuals: bool = False
    cache_state_per_patch: bool = True
    exchanges_halo: bool = True
    merges_whole_queries: bool = True
    wrong_comm_scales: bool = False


@dataclasses.dataclass(frozen=True)
class StrategyReport:
    """What a token strategy tells whoever looks at it (the Lab's views and summaries, the lessons, the
    tests, the memory plan of a request), in one record from one call, `strategy.report(grid, rows)`:
    the runtime classes answer the hooks, and this, nothing else.

    kind                "sequence shards" or "pipefusion stage"
    step                transformer calls since the last reset (a stage's diffusion step); None: not counted
    hands_text          a stage hands on the text states with each patch (SD3, Flux, ...)
    kept_bytes          what the strategy holds between steps now, counted tensor by tensor ({"stale K/V": n})
    busy_s              host seconds a stage spent in its blocks, all calls (its bubble is the rest); None
    staleness           a stage's stale K/V record per layer (StaleKV's written steps and reads); None
    tokens              the image tokens this rank computes for `grid` (rows, cols) of tokens, with `appended` grids
                        of images after it (an edit's reference images); None: none asked
    planned_kept_bytes  what it would keep between steps for `rows` batch rows at `grid` ({}: nothing, or
                        none asked)
    """

    kind: str
    step: int | None
    hands_text: bool
    kept_bytes: dict[str, int]
    busy_s: float | None = None
    staleness: dict | None = None
    tokens: dict | None = None
    planned_kept_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
