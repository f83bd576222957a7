"""DenoiseSession: the one denoising loop, one step at a time.

`pipe(...)` is a session run to the end, so stepping in a notebook and running in production
execute the same code:

    session = pipe.session("a handwritten 7", num_inference_steps=20, seed=0)
    session.step()            # exactly one scheduler step, on every rank
    session.latents           # the whole latents (every rank holds them)
    session.run()             # the remaining steps
    images = session.result(output_type="pil")

Under dp and cfg each rank encodes only its own rows: its dp group's prompts, its cfg branch of
them (the conditioning rows are then gathered, so the forward splits one batch the same way on
every rank), and the VAE decodes only this rank's
images (vae.py); the images are gathered where they are returned.

Each step: duplicate the latents for the [unconditional; conditional] batch, run the
(parallelized) transformer, combine the two predictions with the guidance scale, and step the
scheduler. What differs between families (conditioning, timesteps, decoding) comes from the
family's recipe; the loop does not change.

What one step runs is the token strategy's: one transformer call (models/step.py) for sequence
shards and PipeFusion's drained schedule, or this rank's stage through the patches of its next step
under PipeFusion's async schedule (models/pipefusion/schedules.py, which says what `latents` hold
then). The loop below does not ask which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time

import torch

from . import comm
from .families import Prepared, Request
from .families.recipe import pad_text
from .mesh import CFG, DP, WORLD
from .models import StepContext, parallel_state
from .models.diffusers_cache import DiffusersCache
from .models.teacache import TeaCacheRuntime
from .sharding import shard_sizes

PHASES = ("encode", "prepare", "step", "decode")


class PhaseTimings:
    """Seconds per phase: encode, prepare, each denoising step, decode, measured without waiting for the device.

    A phase is a pair of marks around its block. On a GPU a mark is a CUDA event recorded on the current
    stream: kernels run after the host queues them, so the seconds between two events are what the device
    ran between them, and recording one costs the host nothing. Their elapsed times are read once, when the
    figures are asked for (`steps`, `encode`, ..., `as_dict()`): that read waits for the phase's last event,
    never for a step still running. On a CPU a mark is the host clock (nothing runs asynchronously).

        host    [step 0 queued][step 1 queued][step 2 queued] ... as_dict(): waits for the last mark read
        device     e0 [step 0 runs] e1 [step 1 runs] e2 ...         seconds = elapsed(e0, e1), ...
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._marks: dict[str, list] = {phase: [] for phase in PHASES}  # per block: (start, end), or its seconds

    @contextlib.contextmanager
    def measure(self, phase: str):
        if phase not in self._marks:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        start = self._mark()
        yield
        self._marks[phase].append((start, self._mark()))

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _seconds(self, phase: str) -> list[float]:
        """Every block of `phase` in seconds; read once (marks become floats, events are released)."""
        marks = self._marks[phase]
        for i, mark in enumerate(marks):
            if isinstance(mark, tuple):
                start, end = mark
                if isinstance(start, float):
                    marks[i] = end - start
                else:
                    end.synchronize()  # this event only: the figures were asked for
                    marks[i] = start.elapsed_time(end) / 1000  # milliseconds -> seconds
        return list(marks)

    @property
    def steps(self) -> list[float]:
        return self._seconds("step")

    @property
    def encode(self) -> float:
        return sum(self._seconds("encode"), 0.0)

    @property
    def prepare(self) -> float:
        return sum(self._seconds("prepare"), 0.0)

    @property
    def decode(self) -> float:
        return sum(self._seconds("decode"), 0.0)

    def as_dict(self) -> dict:
        steps = self.steps
        return dict(encode=self.encode, prepare=self.prepare, steps=steps, denoise=sum(steps), decode=self.decode)


class DenoiseSession:
    """One generation, stepped. `timeline=True` (the Lab and the explorer turn it on) records each step's
    comm_timeline into `last_step_spans`: host clock readings around every collective, posting, wait and
    PipeFusion patch, for session.timeline(). Off by default: a production step records only the bytes
    (comm_per_step, always), and waits for nothing on the host."""

    def __init__(self, pipe, request: Request, *, progress: bool = False, timeline: bool = False):
        self.pipe, self.request, self.recipe = pipe, request, pipe.recipe
        self.timings = PhaseTimings(pipe.device)
        self.comm_per_step: list[dict[str, int]] = []  # bytes out of this rank, per group, per step
        self.record_timeline = timeline  # may be switched between steps
        self.last_step_spans: dict | None = None  # the last recorded step's comm_timeline (lab: session.timeline())
        self.cache_skips: list[bool] = []  # per step: whether a StepCache skipped the blocks after the first
        self.cache_changes: list[float | None] = []  # per step: the first block's relative change it measured
        # per step: which of the recipe's transformers ran it (0, but at Wan 2.2 A14B's low-noise steps), each
        # with a StepCache state of its own
        self.step_experts: list[int] = []
        self.comm_decode: dict[tuple[str, str], int] | None = None  # (group, tag): bytes, once decoded
        self.comm_encode: dict[str, int] = {}  # bytes out of this rank while encoding, per group
        self.progress = progress
        self.step_index = 0
        inner = pipe.diffusers_pipeline
        for transformer in self.recipe.transformers(inner):  # e.g. PipeFusion warms up again, the cache empties
            parallel_state(transformer).reset()
        if pipe.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pipe.device)  # the peak a session reports is its own
        with torch.no_grad():
            with self.timings.measure("encode"), comm.comm_log() as log:
                self.prepared, self.own_prompts = encode_own_prompts(
                    self.recipe, inner, request, pipe.mesh, pipe.device
                )
            self.comm_encode = log.bytes_by_group()
            with self.timings.measure("prepare"):
                self.recipe.prepare(inner, request, self.prepared, pipe.device)
        check_same_inputs(pipe.mesh, request, self.prepared)

    # ---- state ------------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self.prepared.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def timestep(self):
        """The timestep the next step() runs at (None when done)."""
        return None if self.done else self.prepared.timesteps[self.step_index]

    @property
    def latents(self) -> torch.Tensor:
        """The whole current latents (every rank holds the full batch)."""
        return self.prepared.latents

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> DenoiseSession:
        """Run exactly one scheduler step on all ranks. Nothing here waits for the device: the step's
        kernels and transfers are queued, its timing is a pair of events (PhaseTimings); a StepCache's
        decision is the one read back (models/cache.py)."""
        if self.done:
            raise RuntimeError(f"all {self.num_steps} steps are done; call result() or start a new session")
        inner = self.pipe.diffusers_pipeline
        t = self.prepared.timesteps[self.step_index]
        transformer = self.recipe.transformer_for(inner, self.prepared, t)
        state = parallel_state(transformer)
        experts = self.recipe.transformers(inner)
        if self.step_experts and experts[self.step_experts[-1]] is not transformer:
            # the expert ran last is done for now (Wan 2.2 A14B's switch at boundary_ratio): what its token strategy
            # keeps between steps goes (PipeFusion's stale K/V, which this one warms up anew); its cache state stays
            parallel_state(experts[self.step_experts[-1]]).strategy.reset()
        if isinstance(state.cache, TeaCacheRuntime):  # TeaCache runs every call of a session's last step
            state.cache.final = self.step_index == self.num_steps - 1
        timeline = comm.comm_timeline() if self.record_timeline else contextlib.nullcontext()
        self.prepared.step_index = self.step_index
        cache_step = contextlib.nullcontext()
        if isinstance(state.cache, DiffusersCache):  # diffusers' hooks read their cache context, opened as diffusers'
            # pipeline opens it: the scheduler's sigma goes in where the family's pipeline puts it (SeaCache reads it)
            sigma = None
            if type(inner).__name__ in state.adapter.cache_sigma_pipelines:
                sigma = float(inner.scheduler.sigmas[self.step_index])
            cfg_apart = self.prepared.do_cfg and not self.recipe.cfg_in_one_call
            cache_step = state.cache.step(self.step_index, self.num_steps, t, cfg_apart, sigma=sigma)
        with torch.no_grad(), self.timings.measure("step"), comm.comm_log() as log, timeline as spans, cache_step:
            state.strategy.run_step(self._context(), t)
        self.comm_per_step.append(log.bytes_by_group())
        if spans is not None:
            self.last_step_spans = dict(step=self.step_index, seconds=spans.end_s - spans.start_s, spans=spans.rows())
        self.cache_skips.append(bool(state.cache and state.cache.skips[-1]))  # the same on every rank: agreed
        self.cache_changes.append(state.cache.changes[-1] if state.cache else None)
        self.step_experts.append([id(m) for m in experts].index(id(transformer)))
        self.step_index += 1
        return self

    def _context(self) -> StepContext:
        """What the token strategy's step is handed: this step, not the session."""
        inner = self.pipe.diffusers_pipeline
        return StepContext(inner, self.prepared, self.recipe, self.step_index, self.num_steps)

    def run(self) -> DenoiseSession:
        """Run the remaining steps (with a progress bar on the first rank when asked)."""
        bar = None
        if self.progress and self.pipe.mesh.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.num_steps, initial=self.step_index, desc="denoising")
        while not self.done:
            self.step()
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        return self

    def result(self, output_type: str = "pil", return_dict: bool = True):
        """Decode the latents (skipped for output_type="latent") into the family's output type."""
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type must be 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        if not self.done:
            raise RuntimeError(f"{self.num_steps - self.step_index} of {self.num_steps} steps remain: call run() first")
        with torch.no_grad(), self.timings.measure("decode"), comm.comm_log() as log:
            images = self.recipe.decode(self.pipe.diffusers_pipeline, self.prepared, self.prepared.latents, output_type)
        self.comm_decode = {(r.group, r.tag): 0 for r in log.records}  # bytes out of this rank in the decode
        for r in log.records:
            self.comm_decode[r.group, r.tag] += r.bytes_out
        if not return_dict:
            return self.recipe.output_tuple(images)
        output = self.recipe.wrap_output(images)
        output.timings = self.timings.as_dict()  # an attribute beside the diffusers fields
        output.comm_encode = dict(self.comm_encode)  # bytes out of this rank, per group, in each phase
        output.comm_per_step = list(self.comm_per_step)
        output.comm_decode = {}
        for (group, _tag), n in self.comm_decode.items():
            output.comm_decode[group] = output.comm_decode.get(group, 0) + n
        output.cache_skips = list(self.cache_skips)
        return output


def encode_own_prompts(recipe, pipe, request: Request, mesh, device) -> tuple[Prepared, range]:
    """The family's encode, run on this rank's own rows only: a dp group encodes its own prompts, and
    under cfg 2 each cfg rank its own branch (negative or positive) of them. The conditioning rows
    are then all-gathered (over cfg, then dp; tag "encode"), so every rank holds the batch's
    conditioning in the serial order and the forward splits one batch as before.

        prompts      p0 p1 | p2                    dp 2 × cfg 2, three prompts: 2 + 1
        encodes      dp0·cfg0: neg p0 p1   dp0·cfg1: pos p0 p1   dp1·cfg0: neg p2   dp1·cfg1: pos p2
        gathered     [neg p0 p1 p2; pos p0 p1 p2] on every rank

    A dp group without a prompt of its own (fewer prompts than groups) encodes the last prompt
    and contributes no rows; its forward computes a stand-in row, dropped by the gather.
    Returns the prepared conditioning and the indices of this rank's own prompts."""
    dp, total = mesh.group_size(DP), len(request.prompts)
    recipe.check_branches(mesh.group_size(CFG), request)
    split_branches = mesh.group_size(CFG) == 2 and recipe.do_cfg(request)
    if dp == 1 and not split_branches:
        return recipe.encode(pipe, request, device), range(total)
    sizes = shard_sizes(total, dp)
    start, count = sum(sizes[: mesh.group_rank(DP)]), sizes[mesh.group_rank(DP)]
    mine = slice(start, start + count) if count else slice(total - 1, total)
    own = dataclasses.replace(
        request,
        prompts=request.prompts[mine],
        negatives=None if request.negatives is None else request.negatives[mine],
    )
    prepared = recipe.encode(pipe, own, device, branch=mesh.group_rank(CFG) if split_branches else None)
    if recipe.padded_text:  # every rank's rows padded to the longest text of any rank, so that they gather
        lengths = comm.all_gather_object(prepared.conditioning[recipe.padded_text[0]].shape[1], mesh, WORLD, tag="text")
        prepared.conditioning = pad_text(prepared.conditioning, recipe.padded_text, max(lengths))
    branches, rows = (2 if prepared.do_cfg and not split_branches else 1), len(own.prompts)
    unbatched = (*parallel_state(pipe.transformer).adapter.unbatched, *recipe.unbatched_conditioning)
    for key, value in prepared.conditioning.items():
        if key in unbatched or not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0 or value.shape[0] != branches * rows:
            raise ValueError(
                f"{recipe.family}'s conditioning {key!r} has {value.shape[0] if value.dim() else 0} rows for "
                f"{rows} prompts × {branches} branches; mark it unbatched in the family adapter"
            )
        parts = list(value.chunk(branches))
        if split_branches:  # [this branch] -> [negative; positive], each of this dp group's rows
            parts = list(comm.all_gather(value.contiguous(), mesh, CFG, dim=0, tag="encode").chunk(2))
        parts = [part[:count] for part in parts]  # a stand-in contributes no rows
        prepared.conditioning[key] = torch.cat(
            [comm.all_gather(part.contiguous(), mesh, DP, dim=0, sizes=sizes, tag="encode") for part in parts]
        )
    return prepared, range(start, start + count)


def _digest(value) -> str:
    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        h.update(str((value.dtype, tuple(value.shape))).encode())
        h.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value):
            h.update(key.encode())
            h.update(_digest(value[key]).encode())
    elif isinstance(value, (list, tuple)):
        for item in value:
            h.update(_digest(item).encode())
    elif hasattr(value, "tobytes"):  # a numpy array or a PIL image (whose repr holds its address)
        h.update(repr((type(value).__name__, getattr(value, "mode", None), getattr(value, "shape", None))).encode())
        h.update(repr(getattr(value, "size", None)).encode())
        h.update(value.tobytes())
    else:
        h.update(repr(value).encode())
    return h.hexdigest()[:16]


def check_same_inputs(mesh, request: Request, prepared: Prepared) -> None:
    """All-gather a hash of every input and raise on every rank if any rank differs."""
    fields = dict(
        prompts=request.prompts,
        negatives=request.negatives,
        steps=request.num_inference_steps,
        guidance=request.guidance_scale,
        size=(request.height, request.width),
        options=sorted(request.options.items()),
        latents=prepared.latents,
    )
    # Text embeddings are left out: GPU kernels need not be bit-reproducible across devices.
    mine = {name: _digest(value) for name, value in fields.items()}
    everyone = comm.all_gather_object(mine, mesh, WORLD, tag="input_hash")
    differing = sorted({name for other in everyone for name in mine if other[name] != mine[name]})
    if differing:
        ranks = mesh.group_ranks(WORLD)
        detail = "; ".join(
            f"{name}: " + ", ".join(f"rank {r} {h[name][:8]}" for r, h in zip(ranks, everyone)) for name in differing
        )
        raise ValueError(
            f"ranks hold different inputs ({', '.join(differing)}): {detail}. Every rank must get the "
            f"same prompts, negatives, seed, sizes and options: pass them from one place (the CLI or "
            f"the Lab), and seed with seed=N or a CPU generator"
        )
