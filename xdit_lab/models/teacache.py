"""TeaCache (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model"), with one
decision for the whole batch that every rank takes together: StepCache(threshold, method="teacache").

At every transformer call the first block's timestep-modulated input m, what the family's adapter computes of the
block's arguments (FamilyAdapter.teacache: Flux's norm1(hidden_states, emb=temb), Wan's norm1(hidden_states) ×
(1 + scale) + shift from its scale_shift_table and temb), is compared with the previous call's (not the last full
one's):

    change = poly(Σ|m - m_prev| / Σ|m_prev|)          over every token of every image in the batch
    accumulated += change
    accumulated < threshold:  skip every block; the image states get what the whole stack added at the last
                              full call (and the text what it added to the text)
    else:                     run every block, accumulated = 0

The first call, and those of a session's last step (Session sets `final` before it), always run.
The two sums are taken over this rank's tokens and all-reduced over every rank (group "world", tag "cache", from the
second call on, as First-Block Cache's: one closed form in traffic.py), so all ranks decide from the same two
numbers; a dp stand-in row counts nothing. A batch of [uncond; cond] (on one rank, or split by cfg) takes one
decision from the sums over both halves, where TeaCache's Wan code keeps a counter for each of diffusers' two calls
a step: the same decisions wherever the modulated input does not read the text (Wan's: the timestep alone modulates
the patch embedding, the text enters later by cross-attention), else one change for both, the halves' averaged,
weighed by each half's Σ|m_prev| (Flux's temb reads the pooled text). What the stack added is kept per patch of this
rank's tokens by First-Block Cache's block wrappers (cache.py), here wrapped around every block, the first one
included: the decision is taken before the first block runs, where TeaCache takes it.

Sequence shards only (ulysses, ring, cfg, dp): accelerations.py refuses PipeFusion, tp, compile, a ControlNet's
residuals and the families whose adapter does not say how to compute the modulated input (`teacache` None).
"""

from __future__ import annotations

import functools
import math

import torch

from .. import comm
from ..families import block_metadata
from ..mesh import WORLD
from .cache import FirstBlockCache, _wrap, cached_blocks


class TeaCacheRuntime(FirstBlockCache):
    """The runtime of StepCache(method="teacache") on one parallelized module: `skips` and `changes` (the
    rescaled change, None at the first call) per call since reset(); `final`: the calls now are a session's last
    step's, which always run (set by Session; by hand, where a model is called step by step)."""

    def __init__(self, settings, state, blocks: list, joined: list[bool]):
        self.settings, self.state = settings, state
        if joined[0]:
            raise TypeError("TeaCache reads the first block's image states alone; this one takes [text; image]")
        meta = [block_metadata(block) for block in blocks]
        for index, (block, block_meta, block_joined) in enumerate(zip(blocks, meta, joined)):
            last = index == len(blocks) - 1
            rest = functools.partial(self._rest, block_meta, block_joined, index == 0, last)
            if index == 0:
                _wrap(state.hooks, block, functools.partial(self._head, block_meta, block, rest))
            else:
                _wrap(state.hooks, block, rest)
        self.passes_first = False
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.previous = None  # this rank's modulated input at the previous call
        self.accumulated = 0.0
        self.final = False

    def begin(self, latents: torch.Tensor, block_residuals: bool = False) -> None:
        if block_residuals:
            raise NotImplementedError(
                "StepCache(method='teacache') does not take a ControlNet's residuals yet (it skips every block, "
                "between which the forward adds them); use StepCache(threshold) (First-Block Cache) with a ControlNet"
            )
        if tuple(latents.shape) != self.shape:  # a new size: nothing cached fits, the count starts over
            self.reset()
            self.shape = tuple(latents.shape)
        self.sums = torch.zeros(2, device=latents.device, dtype=torch.float32)
        self.takes_out_between = False

    def _head(self, meta, block, rest, forward, *args, **kwargs):
        """The first block: measure its modulated input, decide for the whole stack, then run it (or pass on)."""
        argument = functools.partial(_argument, meta, args, kwargs)
        self.image_tokens = argument("hidden_states").shape[1]
        modulated = self.state.adapter.teacache(block, argument)
        if self.previous is not None and not self.state.stand_in:
            previous = self.previous
            self.sums += torch.stack([(modulated - previous).abs().sum(), previous.abs().sum()]).float()
        has_previous = self.previous is not None
        self.previous = modulated
        self._decide(has_previous)
        return rest(forward, *args, **kwargs)

    def _decide(self, has_previous: bool) -> None:
        change = None
        if has_previous:
            self._local_sums.append(self.sums.clone())  # no sync: read only when asked (local_changes)
            if self.state.controls.cache_agrees:
                comm.all_reduce(self.sums, self.state.mesh, WORLD, tag="cache")
            differing, total = self.sums.tolist()  # the one host sync of a call
            change = _rescaled(self.settings.coefficients, differing / total if total > 0 else math.inf)
        forced = change is None or not self.has_reference or self.final
        if not forced:
            self.accumulated += change
        self.run_rest = forced or not self.accumulated < self.settings.threshold
        if self.run_rest:
            self.accumulated = 0.0
            self.has_reference = True
        self.skips.append(not self.run_rest)
        self.changes.append(change)

    @property
    def local_changes(self) -> list[float | None]:
        """Per call, the rescaled change this rank's own tokens alone would give (None where nothing was
        compared): what a per-rank decision would have used."""
        unscaled = super().local_changes
        return [None if c is None else _rescaled(self.settings.coefficients, c) for c in unscaled]


def _argument(meta, args, kwargs, name: str):
    """The block's forward argument `name` as this call passed it; None where the call left it to its default."""
    try:
        return meta._get_parameter_from_args_kwargs(name, args, kwargs)
    except IndexError:  # a positional slot the call did not fill
        return None


def _rescaled(coefficients: tuple[float, ...], x: float) -> float:
    """numpy.poly1d(coefficients)(x), highest power first (Horner)."""
    if math.isinf(x):
        return x
    value = 0.0
    for c in coefficients:
        value = value * x + c
    return value


def apply_teacache(transformer, state, settings) -> TeaCacheRuntime:
    """Wrap every block of a module that parallelize has set up under sequence shards."""
    return TeaCacheRuntime(settings, state, *cached_blocks(transformer, state.adapter))
