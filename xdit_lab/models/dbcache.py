"""DBCache (cache-dit's "Dual Block Cache"), with one decision for the whole batch that every rank takes together:
StepCache(threshold, method="dbcache", front=F, back=B, taylor_order=k).

The blocks are cut in three: the first F (the front) and the last B (the back) run at every call; the middle
ones run only when the front changed:

    x ──> front (F blocks) ──> middle ──> back (B blocks) ──> out
          r = front(x) - x      │
                                └─ skipped: front(x) + what the middle added at the last full call
                                   (with k > 0, a TaylorSeer's prediction of it)

    change = Σ|r - r_full| / Σ|r_full|     over every token of every image in the batch

as First-Block Cache's first block (cache.py, whose block wrappers and decision this reuses: two sums all-reduced
over every rank, group "world", tag "cache"), so F=1, B=0, k=0 is First-Block Cache. What the middle added is
kept per patch of this rank's tokens (one patch under sequence shards), the text's beside it where its blocks
return text.

The TaylorSeer calibrator (Liu et al., "From Reusing to Forecasting", as cache-dit applies it to what the middle
added) keeps, per patch, finite differences up to order k over the full calls, in calls: at a full call n after
the full call m, d_0 = y_n and d_{i+1} = (d_i - d_i') / (n - m), where d_i' was d_i at m (a difference of order
i+1 exists once i+1 earlier full calls do); a skipped call n' adds Σ_i d_i · (n' - n)^i / i!.

Sequence shards only (ulysses, ring, cfg, dp): accelerations.py refuses PipeFusion, tp and compile, and a
ControlNet's residuals are refused here (begin).
"""

from __future__ import annotations

import functools
import math

from ..families import block_metadata
from .cache import FirstBlockCache, _wrap, cached_blocks


class DBCache(FirstBlockCache):
    """The runtime of StepCache(method="dbcache") on one parallelized module: `skips` and `changes` per call since
    reset(), as First-Block Cache's; `kept`: the indices of the blocks a skipped call runs (front and back)."""

    def __init__(self, settings, state, blocks: list, joined: list[bool]):
        self.settings, self.state = settings, state
        front, back = settings.front, settings.back
        if front + back >= len(blocks):
            raise ValueError(
                f"StepCache(method='dbcache') front={front} and back={back} leave no block of "
                f"{state.adapter.family}'s {len(blocks)} to skip; "
                f"give front + back < {len(blocks)}"
            )
        if joined[front - 1]:
            raise TypeError("DBCache reads the front's image states alone; its last block takes [text; image]")
        meta = [block_metadata(block) for block in blocks]
        if front > 1:  # the front's input, where its residual is measured from
            _wrap(state.hooks, blocks[0], functools.partial(self._front_starts, meta[0]))
        _wrap(state.hooks, blocks[front - 1], functools.partial(self._first, meta[front - 1], front == 1))
        middle = range(front, len(blocks) - back)
        for index in middle:
            rest = functools.partial(self._rest, meta[index], joined[index], index == middle[0], index == middle[-1])
            _wrap(state.hooks, blocks[index], rest)
        self.kept = [*range(front), *range(len(blocks) - back, len(blocks))]
        self.passes_first = False
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.derivatives: dict = {}  # per patch (and patch set, for text): d_0..d_k at the last full call
        self.full_call = None  # the index of the last full call

    def begin(self, latents, block_residuals: bool = False) -> None:
        if block_residuals:
            raise NotImplementedError(
                "StepCache(method='dbcache') does not take a ControlNet's residuals yet (they are added between "
                "blocks it skips and blocks it runs); use StepCache(threshold) (First-Block Cache) with a ControlNet"
            )
        super().begin(latents)

    def _front_starts(self, meta, forward, *args, **kwargs):
        self._front_in = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        self.image_tokens = self._front_in.shape[1]
        return forward(*args, **kwargs)

    # ---- the calibrator ----------------------------------------------------------------------------------
    def _keep(self, added: dict) -> None:
        super()._keep(added)
        order, call = self.settings.taylor_order, len(self.skips) - 1
        if order == 0:
            return
        for name, value in added.items():
            if value is None:
                continue
            before = self.derivatives.get(name, [])
            now = [value]
            for i in range(min(order, len(before))):
                now.append((now[i] - before[i]) / (call - self.full_call))
            self.derivatives[name] = now
        self.full_call = call

    def _cached(self, name):
        if self.settings.taylor_order == 0:
            return self.added[name]
        elapsed = len(self.skips) - 1 - self.full_call
        derivatives = self.derivatives[name]
        predicted = derivatives[0]
        for i, d in enumerate(derivatives[1:], start=1):
            predicted = predicted + d * (elapsed**i / math.factorial(i))
        return predicted


def apply_dbcache(transformer, state, settings) -> DBCache:
    """Wrap the front's ends and the middle blocks of a module that parallelize has set up under sequence shards."""
    return DBCache(settings, state, *cached_blocks(transformer, state.adapter))
