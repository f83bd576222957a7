"""StepCache: skip the blocks after the first at steps where the first block barely changed, with
one decision for the whole batch that every rank takes together.

First-Block Cache (ParaAttention's; diffusers' `apply_first_block_cache`) runs the first block at
every step and compares its residual r = block_0(x) - x with the residual of the last step that
ran in full:

    change = Σ|r - r_full| / Σ|r_full|        over every token of every image in the batch

When the change is at most `threshold`, the other blocks are skipped: the hidden states they
would have added are taken from that last full step. The sums are taken locally, then all-reduced
over every rank of the configuration (two numbers per step, group "world", tag "cache"), so all
ranks decide from the same two numbers:

    rank        holds                 local sums     all-reduce (world)
    ulysses 0   tokens [0, S/2)       (a0, b0)   \
    ulysses 1   tokens [S/2, S)       (a1, b1)    >-- (Σa, Σb) --> Σa/Σb > threshold: run, else skip
    pf stage 1  no first block        (0, 0)     /                 (on every rank alike)

Ranks that decided alone would differ, and a rank that skips never calls the collectives its peers
wait in (the hang diffusers' hooks show under context parallelism). Where the decision is taken:
  - sequence shards: inside the forward, when the first block returns;
  - PipeFusion: stage 0 first runs the first block over every patch of the step (its K/V are
    written and read in the same patch order as in the pipelined pass, so nothing changes), then
    every stage joins the all-reduce before any patch moves; the pipelined pass reuses those outputs.
Each rank caches what its own blocks added (after the first), per patch of its tokens (one patch
under sequence shards), and adds it after its last block when skipping: summed over the stages,
that is what the whole tail added. At threshold 0 every step runs in full, exactly as without a
cache. Skipping costs one host sync per step (the decision steers Python), as in diffusers.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from .. import comm
from ..accelerations import StepCache
from ..families import block_metadata
from ..mesh import WORLD


class _FirstBlockDone(Exception):
    """Raised after the first block in PipeFusion's first pass: the rest of the forward comes later."""


class FirstBlockCache:
    """The runtime of a StepCache on one parallelized module: wraps its blocks, keeps the residuals
    and the decisions (`skips`, `changes`: one entry per transformer call since reset()).

    The model's `Controls(cache_agrees=False)` makes each rank decide from its own sums only: a deliberately
    wrong control for tests and the tutorial (the ranks diverge and a collective times out)."""

    def __init__(self, settings: StepCache, state, blocks: list, holds_first_block: bool):
        self.settings, self.state = settings, state
        meta = [block_metadata(block) for block in blocks]
        if holds_first_block:
            _wrap(state.hooks, blocks[0], functools.partial(self._first, meta[0]))
            blocks, meta = blocks[1:], meta[1:]
        for index, (block, block_meta) in enumerate(zip(blocks, meta)):
            _wrap(state.hooks, block, functools.partial(self._rest, block_meta, index == 0, index == len(blocks) - 1))
        self.passes_first = False  # PipeFusion's pipelined pass: the first block's outputs are known
        self.reset()

    def reset(self) -> None:
        """A new generation: the next call runs in full and becomes the reference."""
        self.skips: list[bool] = []
        self.changes: list[float | None] = []
        self._local_sums: list = []  # this rank's own two sums per decided step, on the device
        self.reference: dict = {}  # per patch: the first block's residual at the last full step
        self.candidate: dict = {}  # per patch: this call's
        self.added: dict = {}  # per patch (and per patch set, for text): what this rank's other blocks added
        self.first_outputs: dict = {}
        self.sums, self.shape, self.run_rest, self.has_reference = None, None, True, False

    # ---- one transformer call ------------------------------------------------------------------------
    def begin(self, latents: torch.Tensor) -> None:
        if tuple(latents.shape) != self.shape:  # a new size: nothing cached fits
            self.reset()
            self.shape = tuple(latents.shape)
        self.sums = torch.zeros(2, device=latents.device, dtype=torch.float32)
        self.candidate, self.first_outputs = {}, {}

    def decide(self) -> bool:
        """Run the other blocks this call? One answer on every rank; recorded in skips/changes."""
        change = None
        if self.has_reference:
            self._local_sums.append(self.sums.clone())  # no sync: read only when asked (local_changes)
            if self.state.controls.cache_agrees:
                comm.all_reduce(self.sums, self.state.mesh, WORLD, tag="cache")
            differing, total = self.sums.tolist()  # the one host sync of a step
            change = differing / total if total > 0 else math.inf
        self.run_rest = change is None or change > self.settings.threshold
        if self.run_rest:
            self.reference = self.candidate  # compared against the last full step, as diffusers does
            self.has_reference = True
        self.skips.append(not self.run_rest)
        self.changes.append(change)
        return self.run_rest

    @property
    def local_changes(self) -> list[float | None]:
        """Per call, the change this rank's own tokens alone would give (None where nothing was
        compared): what a per-rank decision would have used."""
        local = iter(self._local_sums)
        out = []
        for change in self.changes:
            if change is None:
                out.append(None)
                continue
            differing, total = next(local).tolist()
            out.append(differing / total if total > 0 else math.inf)
        return out

    def first_pass(self, run, patch_sets: list[list[int]], set_active) -> None:
        """PipeFusion's stage 0: the first block over every patch set, keeping its outputs."""
        for active in patch_sets:
            set_active(active)
            try:
                run()
            except _FirstBlockDone:
                continue
            raise RuntimeError("the first block did not run in PipeFusion's first pass")
        self.passes_first = True

    def end(self) -> None:
        self.passes_first, self.first_outputs = False, {}

    # ---- the block wrappers ----------------------------------------------------------------------------
    def _first(self, meta, forward, *args, **kwargs):
        hidden_in = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        patches = self.state.strategy.token_patches(hidden_in.shape[1])
        key = tuple(p for p, _ in patches)
        if self.passes_first:
            return self.first_outputs.pop(key)
        output = forward(*args, **kwargs)
        residual = _hidden(meta, output) - hidden_in
        pieces = torch.split(residual, [n for _, n in patches], dim=1)
        for (patch, _), piece in zip(patches, pieces):
            self.candidate[patch] = piece
            reference = self.reference.get(patch)
            if reference is not None and not self.state.stand_in:
                self.sums += torch.stack([(piece - reference).abs().sum(), reference.abs().sum()]).float()
        if self.state.strategy.decides_before_blocks:
            self.first_outputs[key] = output
            raise _FirstBlockDone()
        self.decide()
        return output

    def _rest(self, meta, first, last, forward, *args, **kwargs):
        hidden = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        text = None
        if meta.return_encoder_hidden_states_index is not None:
            text = meta._get_parameter_from_args_kwargs("encoder_hidden_states", args, kwargs)
        patches = self.state.strategy.token_patches(hidden.shape[1])
        key = tuple(p for p, _ in patches)
        if self.run_rest:
            if first:
                self._inputs = (hidden, text)
            output = forward(*args, **kwargs)
            if last:
                hidden_0, text_0 = self._inputs
                added = torch.split(_hidden(meta, output) - hidden_0, [n for _, n in patches], dim=1)
                self.added.update(zip(key, added))
                text_out = _text(meta, output)
                self.added[key] = None if text_out is None or text_0 is None else text_out - text_0
            return output
        if last:  # what this rank's blocks added at the last full step
            hidden = hidden + torch.cat([self.added[p] for p in key], dim=1)
            if text is not None and self.added.get(key) is not None:
                text = text + self.added[key]
        if meta.return_encoder_hidden_states_index is None:
            return hidden
        output = [None, None]
        output[meta.return_hidden_states_index] = hidden
        output[meta.return_encoder_hidden_states_index] = text
        return tuple(output)


def apply_step_cache(transformer, state, settings: StepCache) -> FirstBlockCache:
    """Wrap the blocks of a module that parallelize has set up (a PipeFusion stage holds some)."""
    blocks = state.adapter.blocks(transformer)
    if not blocks:
        raise TypeError(f"StepCache found no transformer blocks in {type(transformer).__name__}")
    return FirstBlockCache(settings, state, blocks, holds_first_block=state.mesh.is_first_stage)


def _hidden(meta, output):
    return output[meta.return_hidden_states_index] if isinstance(output, tuple) else output


def _text(meta, output):
    index = meta.return_encoder_hidden_states_index
    return output[index] if index is not None and isinstance(output, tuple) else None


def _wrap(hooks, block, around) -> None:
    """block.forward = around(the block's own forward, ...), holding the block weakly (no cycle); installed
    in `hooks` as "step_cache[i]"."""
    own, module = type(block).forward, weakref.ref(block)

    def forward(*args, **kwargs):
        return around(functools.partial(own, module()), *args, **kwargs)

    hooks.replace(hooks.numbered("step_cache"), block, forward=forward)
