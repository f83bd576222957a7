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

Blocks that take [text; image] as one tensor (Flux.2's single-stream blocks, the adapter's
joined_block_lists) are read as their two parts: what the tail added to the image is the same
tokens' difference whether the tail ends joined or not (diffusers' own First-Block Cache subtracts
the head block's [text, image] pair from the joined tensor, and raises on Flux.2).

A ControlNet's residuals (the adapter's block_residuals) are added by the forward between blocks, fresh
at every step and at every scale (0 outside control_guidance_start/end). What is cached is what the
tail's blocks themselves added: the residuals added between two of its blocks at the full step are
taken out, and a skipped step's pass through the tail adds its own. Kept in (the control,
Controls(cache_keeps_block_residuals=True)), a skipped step would add the full step's residuals as well
as its own.

Under torch.compile the decision's host sync breaks the graph where it is taken: the graphs before it,
and after it one set per decision (run the blocks, or add what was cached), each traced once; later
steps reuse them without recompiling (tests/test_step_cache_flux2_controlnet_compile.py counts them).
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

    def __init__(self, settings: StepCache, state, blocks: list, holds_first_block: bool, joined: list[bool]):
        self.settings, self.state = settings, state
        meta = [block_metadata(block) for block in blocks]
        self.kept = [0] if holds_first_block else []  # the blocks of this rank a skipped step runs (their indices)
        if holds_first_block:
            if joined[0]:
                raise TypeError("StepCache reads the first block's image states alone; this one takes [text; image]")
            _wrap(state.hooks, blocks[0], functools.partial(self._first, meta[0], True))
            blocks, meta, joined = blocks[1:], meta[1:], joined[1:]
        for index, (block, block_meta, block_joined) in enumerate(zip(blocks, meta, joined)):
            last = index == len(blocks) - 1
            _wrap(state.hooks, block, functools.partial(self._rest, block_meta, block_joined, index == 0, last))
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
        self.image_tokens = None  # this rank's image tokens in the running forward, as the first block took them
        self._front_in = None  # the image states the first block took this call
        self.between = None  # a ControlNet's residuals added between the tail's blocks this call, summed
        self.takes_out_between = False  # ... which this call takes out of what it caches
        self._image_out = None  # the image states the last block run returned (where the next gap starts)

    # ---- one transformer call ------------------------------------------------------------------------
    def begin(self, latents: torch.Tensor, block_residuals: bool = False) -> None:
        """A transformer call on `latents`; `block_residuals`: it carries a ControlNet's residuals, which the
        forward adds between blocks (the module's docstring)."""
        if tuple(latents.shape) != self.shape:  # a new size: nothing cached fits
            self.reset()
            self.shape = tuple(latents.shape)
        self.sums = torch.zeros(2, device=latents.device, dtype=torch.float32)
        self.candidate, self.first_outputs = {}, {}
        self.takes_out_between = block_residuals and not self.state.controls.cache_keeps_block_residuals

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
        return local_changes(self.changes, self._local_sums)

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
    def _first(self, meta, starts: bool, forward, *args, **kwargs):
        """The block whose residual decides: the first block (`starts`), or the last of DBCache's front, whose
        residual is measured from the front's input (_front_in)."""
        if starts:
            self._front_in = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
            self.image_tokens = self._front_in.shape[1]
        hidden_in = self._front_in
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

    def _rest(self, meta, joined, first, last, forward, *args, **kwargs):
        hidden = meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        text = None
        if meta.return_encoder_hidden_states_index is not None:
            text = meta._get_parameter_from_args_kwargs("encoder_hidden_states", args, kwargs)
        image, text = self._parts(hidden, text, joined)
        patches = self.state.strategy.token_patches(image.shape[1])
        key = tuple(p for p, _ in patches)
        if self.run_rest:
            if first:
                self._inputs, self.between = (image, text), None
            elif self.takes_out_between:  # what the forward added since the block before: a ControlNet's residual
                gap = image - self._image_out
                self.between = gap if self.between is None else self.between + gap
            output = forward(*args, **kwargs)
            image_out, text_out = self._parts(_hidden(meta, output), _text(meta, output), joined)
            self._image_out = image_out
            if last:
                image_0, text_0 = self._inputs
                added = image_out - image_0 if self.between is None else image_out - image_0 - self.between
                added = dict(zip(key, torch.split(added, [n for _, n in patches], dim=1)))
                added[key] = None if text_out is None or text_0 is None else text_out - text_0
                self._keep(added)
            return output
        if not last:
            return _passed_on(meta, args, kwargs, hidden)
        # what this rank's blocks added at the last full step
        image = image + torch.cat([self._cached(p) for p in key], dim=1)
        if text is not None and self.added.get(key) is not None:
            text = text + self._cached(key)
        if joined:
            return self._join(image, text)
        if meta.return_encoder_hidden_states_index is None:
            return image
        output = [None, None]
        output[meta.return_hidden_states_index] = image
        output[meta.return_encoder_hidden_states_index] = text
        return tuple(output)

    def _keep(self, added: dict) -> None:
        """A full step's: what this rank's skippable blocks added, per patch (image) and patch set (text)."""
        self.added.update(added)

    def _cached(self, name):
        """What a skipped step adds for patch (or patch set) `name`: the last full step's (DBCache may predict it)."""
        return self.added[name]

    def _parts(self, hidden, text, joined: bool):
        """(image, text) of a block's states: a joined block's one tensor cut at this rank's image tokens (the
        first block's, or the PipeFusion patches' count: token_patches), the others' as they are."""
        if not joined:
            return hidden, text
        image = sum(n for _, n in self.state.strategy.token_patches(self.image_tokens))
        if self.state.adapter.joined_text_last:
            return hidden[:, :image], hidden[:, image:]
        return hidden[:, hidden.shape[1] - image :], hidden[:, : hidden.shape[1] - image]

    def _join(self, image, text):
        return torch.cat([image, text] if self.state.adapter.joined_text_last else [text, image], dim=1)


def cached_blocks(transformer, adapter) -> tuple[list, list[bool]]:
    """The blocks a StepCache wraps, in order, and whether each takes [text; image] joined (a joined block list)."""
    blocks = adapter.blocks(transformer)
    if not blocks:
        raise TypeError(f"StepCache found no transformer blocks in {type(transformer).__name__}")
    joined = [name in adapter.joined_block_lists for name in adapter.block_lists for _ in getattr(transformer, name)]
    return blocks, joined


def apply_step_cache(transformer, state, settings: StepCache) -> FirstBlockCache:
    """Wrap the blocks of a module that parallelize has set up (a PipeFusion stage holds some)."""
    blocks, joined = cached_blocks(transformer, state.adapter)
    return FirstBlockCache(settings, state, blocks, holds_first_block=state.mesh.is_first_stage, joined=joined)


def _passed_on(meta, args, kwargs, hidden):
    """A skipped block's output: its input states as they came (a joined block's one tensor)."""
    if meta.return_encoder_hidden_states_index is None:
        return hidden
    output = [None, None]
    output[meta.return_hidden_states_index] = hidden
    output[meta.return_encoder_hidden_states_index] = meta._get_parameter_from_args_kwargs(
        "encoder_hidden_states", args, kwargs
    )
    return tuple(output)


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


def local_changes(changes: list, local_sums: list) -> list[float | None]:
    """Per call, the change one rank's own sums give (None where the call compared nothing): each of `local_sums`
    a (differing, total) pair of this rank's tokens, one per call whose change is not None."""
    local, out = iter(local_sums), []
    for change in changes:
        if change is None:
            out.append(None)
            continue
        differing, total = next(local).tolist()
        out.append(differing / total if total > 0 else math.inf)
    return out


def kept_block_names(transformer, state) -> list[str]:
    """Module-name prefixes ("transformer_blocks.0.") of this rank's blocks that run at a step its StepCache skips,
    where the closed forms count a skipped step's attention layers: the first block (on PipeFusion's first stage)
    for First-Block Cache, and where no StepCache runs; DBCache's front and back blocks."""
    adapter = state.adapter
    names = [f"{name}.{i}." for name in adapter.block_lists for i in range(len(getattr(transformer, name)))]
    kept = getattr(state.cache, "kept", None)
    if kept is None:  # no StepCache: the first block's, as First-Block Cache's
        return names[:1] if state.mesh.is_first_stage else []
    return [names[i] for i in kept]
