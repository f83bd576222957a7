"""PipeFusionStage: the token strategy of PipeFusion. This rank holds one stage of the blocks and runs
them patch by patch on partly stale K/V (the package's docstring draws the pipeline).

Inside one transformer call every stage runs the model's own forward once per patch (once for the
whole image during warmup):
  - the embeddings are computed from the whole latent and this rank keeps the patch's tokens; a
    later stage replaces them, at its first block, with what the previous stage sent
  - a stage that is not the last stops after its last block and sends the activations on
  - a stage posts patch i+1's receive before it computes patch i, so the next patch arrives while this
    one computes. Receives come in on the link from the previous stage, sends leave on the link to the
    next (RankMesh.link: one communicator per direction), so a send never queues behind a receive (NCCL
    runs one communicator's operations in the order posted). Messages are in the model's dtype.
Joint-attention families (SD3, Flux, CogVideoX, Qwen-Image) change their text in every block, so a
stage hands over the patch's image tokens and the text states its blocks produced for that patch
(whole, on every sp rank). Their attention keeps image K/V per patch and recomputes text K/V (and
its padding mask) with each patch. The blocks are the adapter's stack (Flux: double-stream, then
single-stream), cut into stages as one list; rotary rows and per-token arguments follow the patches.
Z-Image's stack starts with blocks over the image alone, and its forward joins the caption to the image
before its first main layer: a stage starting there takes the image states alone and joins its own
caption (FamilyAdapter.text_joined_at); the padding tokens that model adds after the image go with the
last patch. Where other images' tokens follow the drawn one's (an edit's reference images: Qwen-Image-Edit,
Kontext, Flux.2), patch i is row band i of every image (sharding.patch_layout), and the output buffer holds
every image's tokens, as the model's own output does.
The last stage's output tokens fill one buffer per step, patch by patch (gather), so the last
patch's forward unpatchifies the whole image; that prediction is broadcast to every stage (all
step the scheduler alike). Within a stage, tokens may also be split over ulysses × ring: every
patch is sharded over them the same way (sharding.PatchLayout). A ControlNet's residuals, one list for the whole
model's blocks, are rebased to the blocks a stage holds (adapter.BlockResiduals) and cut with the patches like the
tokens; the ControlNet itself runs whole on every rank. Where the blocks carry a stream beside the image, whole on
every rank (LTX-2's audio: adapter.BesideStream), it travels in the text's place with every patch, its queries
attend to every patch's image K/V kept like self-attention's ("whole_queries"), and its prediction is broadcast with
the image's (families/ltx2.py draws it).
"""

from __future__ import annotations

import time
import weakref

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ... import comm
from ...attention.linear import linear_sums, stale_sums_bytes
from ...attention.stale import StaleKV, stale_attention, stale_kv_bytes
from ...attention.usp import whole_query_attention
from ...families import block_metadata
from ...families.adapter import SEQUENCE_PARALLEL_KINDS
from ...mesh import PIPEFUSION, RING, SP, TP, ULYSSES
from ...sharding import PatchLayout, patch_layout, patch_ranges
from ..diffusers_cache import DiffusersCache
from ..hooks import join_text, keep_forward_per_token, refuse_per_block, refuse_unsplittable, split_text
from ..step import whole_step
from ..strategy import StrategyReport
from .schedules import AsyncSchedule

STALE_KINDS = SEQUENCE_PARALLEL_KINDS  # attention whose image K/V a stage keeps per patch


def _encoder_text_len(arguments: dict) -> int:
    """The joint text's length as the forward takes it: encoder_hidden_states [B, T, C]."""
    return arguments["encoder_hidden_states"].shape[1]


class _StageDone(Exception):
    """Raised after a non-last stage's last block: the rest of the forward belongs to later stages."""

    def __init__(self, hidden, text):
        super().__init__("stage done")
        self.hidden, self.text = hidden, text


class PipeFusionStage:
    """The token strategy of PipeFusion: this rank's stage, its patch layout, stale K/V buffers and
    the step counter. The model's Controls (models/strategy.py, on its parallel state) may make each
    layer's K/V buffer wrong (`buffer_type`), drop the latents sent back to stage 0 under the async
    schedule (`drops_returned_latents`), or hand a ControlNet's residuals unrebased
    (`rebases_block_residuals`)."""

    def __init__(self, state, config, blocks: tuple[int, int], model_config, dtype: torch.dtype):
        self.state, self.mesh, self.config = state, state.mesh, config
        self.module = None  # the transformer, held weakly (apply): its state holds this stage
        self.blocks = blocks  # [start, stop) of the model's blocks held here
        self.dtype = dtype  # of the activations a stage hands over (the model's)
        self.model_config = model_config
        heads, head_dim = state.adapter.attention_shape(model_config)
        self.hidden_size = heads * head_dim
        self.step = 0  # transformer calls since reset: the diffusion step
        self.layout = None
        self.grid = None  # (the drawn image's (rows, cols), the appended images' grids) of the layout
        self.buffers: dict[str, StaleKV] = {}
        self.sums: dict[str, torch.Tensor] = {}  # a linear-attention module's sums per patch [P, B, H, D+1, D]
        self.edges: dict[str, torch.Tensor] = {}  # a convolving module's edge rows per patch [P, 2, B, C, reach, W]
        self.active: list[int] = []
        self.incoming = None  # (image, text) handed over by the previous stage for the running patch
        self.handed_residual = None  # what the forward adds after this stage's last block (a ControlNet's residual)
        self.output = None  # the whole image's output tokens of this step, filled patch by patch
        self.first_block = self.last_block = None  # diffusers' metadata of the blocks held here
        self.first_joined = self.last_joined = False  # a held end block takes / returns [text; image] as one
        self.hands_text = False  # this stage sends text states on with each patch (when it is not the last)
        self.takes_text = False  # ... and the stage before sends them to this one
        self.block_names: dict[str, str] = {}  # a held block's name here -> its name in the whole model
        self.indices: dict = {}  # token index tensors on the device, per layout: no host copy per patch
        self.token_grids: dict = {}  # one sample's latent shape -> (rows, cols) of its image tokens, appended grids
        # the async schedule (ParallelConfig.pipefusion_schedule), past its warmup: one call runs one patch
        self.schedule = AsyncSchedule(self) if config.pipefusion_schedule == "async" else None
        self.busy_s = 0.0  # seconds in this stage's blocks, all calls (the bubble is the rest of a step)
        # what the hooks install (TokenStrategy): every token hook and every attention; the text stays whole
        self.splits_tokens = self.takes_attention = True
        self.text_shard_at = None

    @classmethod
    def apply(cls, transformer, state, config) -> PipeFusionStage:
        """Keep this stage's blocks of `transformer` (drop the others, unless it was loaded as a stage)
        and hook its first and last block to receive and hand over activations."""
        mesh, adapter = state.mesh, state.adapter
        stage_index = mesh.coords[PIPEFUSION]
        start, stop = config.stage_ranges(adapter.num_blocks(transformer.config))[stage_index]
        loaded = getattr(transformer, "_xdit_lab_stage_blocks", None)
        block_0 = None
        if loaded is None:  # built whole: drop the other stages' blocks (load_pipeline never builds them)
            block_0 = adapter.blocks(transformer)[0]
            adapter.keep_blocks(transformer, start, stop)
            # a stage from now on (unparallelize does not bring the dropped blocks back)
            transformer._xdit_lab_stage_blocks = (start, stop, adapter.num_blocks(transformer.config))
        elif loaded[:2] != (start, stop):
            raise ValueError(
                f"this transformer holds blocks {loaded[:2]}, but stage {stage_index} of {config.pipefusion} runs "
                f"blocks {(start, stop)}"
            )
        if adapter.beside is not None and config.pipefusion_schedule == "async":
            raise NotImplementedError(
                f"pipefusion_schedule='async' steps the image's latents patch by patch, and {adapter.family}'s blocks "
                f"carry a second stream (its {adapter.beside.argument}) stepped whole; run the drained schedule"
            )
        stage = cls(state, config, (start, stop), transformer.config, next(transformer.parameters()).dtype)
        stage.module = weakref.ref(transformer)
        if adapter.output_conditioning is not None and mesh.is_last_stage and start > 0:
            if block_0 is None:
                raise ValueError(
                    f"a {adapter.family} stage loaded without block 0 cannot condition its output layer; build the "
                    "transformer whole and let parallelize drop the other stages' blocks"
                )
            adapter.output_conditioning(transformer, block_0, state.hooks)
        stage.block_names = adapter.stage_block_names(transformer.config, start, stop)
        blocks = adapter.blocks(transformer)
        stage.first_block, stage.last_block = block_metadata(blocks[0]), block_metadata(blocks[-1])
        held = [name.rsplit(".", 1)[0] for name in stage.block_names]  # the list each held block sits in
        stage.first_joined = held[0] in adapter.joined_block_lists  # Flux.2's single-stream: [text; image]
        stage.last_joined = held[-1] in adapter.joined_block_lists
        stage.hands_text = stage.last_joined or stage.last_block.return_encoder_hidden_states_index is not None
        # a stage whose first block takes text takes it from the stage before, but where the forward joins its own
        # text to the image (Z-Image's first main layer: no block before it hands text on)
        takes_text = stage.first_joined or stage.first_block.return_encoder_hidden_states_index is not None
        stage.takes_text = takes_text and next(iter(stage.block_names.values())) != adapter.text_joined_at
        if not mesh.is_first_stage:
            state.hooks.forward_pre_hook("pipefusion.take_incoming", blocks[0], stage._take_incoming, with_kwargs=True)
        if not mesh.is_last_stage:
            state.hooks.forward_hook("pipefusion.hand_over", blocks[-1], stage._hand_over)
        return stage

    # ---- what the views and the planner ask -----------------------------------------------------------
    def report(self, grid: tuple[int, int] | None = None, rows: int | None = None, appended=()) -> StrategyReport:
        """This stage now (its step, its stale K/V held and their record, its seconds in its blocks), its
        pieces of every patch of a `grid` of tokens (and the `appended` grids of images after it: an edit's
        reference images), and the stale K/V it keeps for `rows` batch rows there."""
        planned = {} if grid is None or rows is None else self.planned_kept_bytes(self.module(), rows, grid, appended)
        return StrategyReport(
            kind="pipefusion stage",
            step=self.step,
            hands_text=self.hands_text,
            kept_bytes=self._kept_bytes(),
            busy_s=self.busy_s,
            staleness=self._staleness(),
            tokens=None if grid is None else self._token_pieces(grid, tuple(appended)),
            planned_kept_bytes=planned,
        )

    def planned_kept_bytes(self, transformer, rows: int, grid: tuple[int, int], appended=()) -> dict[str, int]:
        """{"stale K/V": bytes} of the buffers this stage keeps between steps once a step ran with `rows`
        batch rows on this rank and `grid` (rows, cols) of tokens as PipeFusion cuts them (a video's
        frames stacked as rows: LatentLayout.token_grid), with the `appended` grids after it: stale_kv_bytes,
        for its blocks' attention, and a linear attention's sums and a convolution's edge rows per patch (Sana's).
        Under tp this rank attends its 1/tp of the heads, and keeps theirs alone."""
        config, element = transformer.config, torch.empty((), dtype=self.dtype).element_size()
        adapter, names = self.state.adapter, [name for name, _ in transformer.named_modules()]
        linear, convolving = (sum(counts) for counts in zip(*adapter.stale_mixing_layers(names, config)))
        heads, head_dim = adapter.attention_shape(config)
        heads //= self.mesh.group_size(TP)
        kv = stale_kv_bytes(
            layers=sum(adapter.stale_kv_layers(names, config)),
            rows=rows,
            heads=heads,
            head_dim=head_dim,
            grid=grid,
            padded=adapter.latents.padded_tokens(grid[0] * grid[1], config),
            patches=self.config.patches,
            ulysses=self.mesh.group_size(ULYSSES),
            ring=self.mesh.group_size(RING),
            ring_rank=self.mesh.group_rank(RING),
            element_bytes=element,
            ulysses_rank=self.mesh.group_rank(ULYSSES),
            appended=appended,
        )
        patches, width = self.config.patches, heads * head_dim
        kv += stale_sums_bytes(linear, rows, heads, head_dim, patches)
        # a "whole_queries" layer's (LTX-2's video-to-audio) keeps this rank's tokens of every patch, every head
        whole_queries = [m for n, m in transformer.named_modules() if adapter.attention_kind(n) == "whole_queries"]
        if whole_queries:
            padded = adapter.latents.padded_tokens(grid[0] * grid[1], config)
            layout = patch_layout(grid, patches, self.config.sp_degree, appended, padded=padded)
            own = sum(layout.chunk_len(p, self.mesh.group_rank(SP)) for p in range(len(layout.patches)))
            kv += sum(2 * rows * m.heads * m.head_dim * own * element for m in whole_queries)
        if adapter.row_convolution is not None:
            kv += adapter.row_convolution.stale_halo_bytes(convolving, rows, grid, patches, width, element)
        return {"stale K/V": kv}

    def _kept_bytes(self) -> dict[str, int]:
        """{"stale K/V": bytes} of the buffers this stage holds now, counted tensor by tensor (with a linear
        attention's sums and a convolution's edge rows per patch, kept like K/V)."""
        held = [t for b in self.buffers.values() for t in (b.keys, b.values) if t is not None]
        held += [*self.sums.values(), *self.edges.values()]
        return {"stale K/V": sum(t.numel() * t.element_size() for t in held)}

    def _token_pieces(self, grid: tuple[int, int], appended: tuple) -> dict:
        """The image tokens this rank computes for a rows × cols token grid (and the appended grids): its
        piece of every patch as [start, stop) ranges of the sequence, patch by patch (the layout of the last
        forward when it had these grids, else computed the same way); `patches`: the grid's row bands."""
        sp, sp_rank = self.config.sp_degree, self.mesh.group_rank(SP)
        recorded = self.layout is not None and self.grid == (tuple(grid), appended)
        layout = self.layout if recorded else self._patch_layout(tuple(grid), appended)
        pieces = [list(piece) for p in range(len(layout.patches)) for piece in layout.rank_ranges(p, sp_rank)]
        return dict(
            sp_size=sp,
            sp_rank=sp_rank,
            tokens=pieces,
            pipefusion=dict(
                stage=self.mesh.coords[PIPEFUSION],
                blocks=list(self.blocks),
                patches=[list(p) for p in patch_ranges(*grid, self.config.patches)],
                patch_tokens=pieces,
            ),
            source="PatchLayout" if recorded else "computed (no forward yet)",
        )

    def run_step(self, context, t) -> None:
        """One denoising step (`context`: a StepContext): one transformer call (the drained schedule, and
        every warmup step), or this stage's patches of its next step under the async schedule (schedules.py)."""
        if self.pipelined:
            self.schedule.step(context, t)
        else:
            whole_step(context, t)

    def reset(self) -> None:
        """A new generation: warm up again with empty buffers (and the async schedule starts over)."""
        if self.schedule is not None:
            self.schedule.reset()
        self.step, self.buffers, self.layout, self.grid, self.sums, self.edges = 0, {}, None, None, {}, {}
        # the grids too: another generation of the same size may split its reference tokens otherwise
        self.token_grids = {}

    @property
    def pipelined(self) -> bool:
        """The async schedule past its warmup: each call runs one patch, and the last stage steps the
        scheduler patch by patch (schedules.py)."""
        return self.schedule is not None and self.step >= self.config.warmup_steps

    # ---- one diffusion step ----------------------------------------------------------------------------
    def forward(self, run, bound):
        """Every patch set through this stage's blocks; the last stage's prediction, broadcast."""
        mesh, adapter = self.mesh, self.state.adapter
        latents = bound.arguments[adapter.latents_argument]  # [B, ...], or one tensor per sample (Z-Image's list)
        per_sample = isinstance(latents, list)
        first = latents[0]  # a sample: the device the receive buffers are made on
        refuse_unsplittable(bound.arguments)
        self._rebase_block_residuals(bound.arguments)
        refuse_per_block(bound.arguments, adapter)
        size = tuple(first.shape if per_sample else latents.shape[1:])  # one sample's: the batch keeps the grid
        if size not in self.token_grids:  # Flux reads its grid from img_ids: once per size, not per step
            grid = adapter.latents.token_grid(latents, self.model_config, bound.arguments)
            self.token_grids[size] = (grid, adapter.latents.appended_grids(bound.arguments))
        patch_sets = self._begin_step(*self.token_grids[size])
        # the whole image's tokens, padding included (a stage that holds no block the tokens are cut at reads it here)
        self.state.image_len = self.layout.patches[-1][1]
        sp_rank, batch = mesh.group_rank(SP), len(latents)
        if adapter.beside is not None and bound.arguments.get("return_dict", True):
            raise NotImplementedError(
                f"a {adapter.family} PipeFusion stage returns its two predictions as a tuple: call it with "
                "return_dict=False, as its pipeline does"
            )
        # a stage hands over the text states its blocks changed (SD3, Flux, CogVideoX) with the patch
        text_len, text_width, beside = 0, self.hidden_size, adapter.beside
        if beside is not None:  # the stream the blocks carry beside the image (LTX-2's audio) goes in the text's place
            text_len, text_width = bound.arguments[beside.argument].shape[1], beside.width(self.model_config)
            self.state.handed_beside = text_len * text_width
        elif self.takes_text:  # its length as the blocks take it (the forward joins it: Z-Image, HunyuanVideo-1.5)
            text_len = (adapter.joint_text_len or _encoder_text_len)(bound.arguments)
        text_len = text_len if self.takes_text else 0
        whole = dict(bound.arguments)  # the forward's per-token arguments, cut again for every patch set

        def run_active():  # arguments with one entry per image token keep the active patches' entries
            keep_forward_per_token(self.state, bound.arguments, whole)
            self.handed_residual = self._last_block_residual(bound.arguments)
            return run()

        def receive(active):  # the previous stage's activations, into buffers of the model's dtype
            tokens = sum(self.layout.chunk_len(p, sp_rank) for p in active)
            image = first.new_empty((batch, tokens, self.hidden_size), dtype=self.dtype)
            text = first.new_empty((batch, text_len, text_width), dtype=self.dtype) if text_len else None
            buffers = [(t, mesh.pipeline_prev) for t in (image, text) if t is not None]
            return (image, text), comm.exchange([], buffers, mesh, PIPEFUSION)

        cache, pipelined = self.state.cache, self.pipelined
        per_patch = isinstance(cache, DiffusersCache)  # diffusers' hooks: a state per patch (models/diffusers_cache.py)
        if cache is not None and not per_patch:  # one decision for the step before any patch moves (models/cache.py)
            if mesh.is_first_stage:
                cache.first_pass(run_active, patch_sets, self._set_active)
            cache.decide()
        receiving = None if mesh.is_first_stage else receive(patch_sets[0])
        sends, output = [], None
        if not pipelined:  # pipelined, the buffer keeps the other patches' latest tokens
            self.output = None
        for i, active in enumerate(patch_sets):
            self.active = active
            if per_patch:
                cache.patches(active, self.layout)
            if receiving is not None:
                incoming, requests = receiving
                if i + 1 < len(patch_sets):  # one patch ahead, arriving while this one computes
                    receiving = receive(patch_sets[i + 1])
                comm.wait(requests)
                self.incoming = incoming
            started = time.perf_counter()
            label = f"patch {active[0]}" if len(active) == 1 else f"patches {active[0]}-{active[-1]}"
            try:
                with comm.computing(PIPEFUSION, label):  # the timeline's patch × stage chart
                    output = run_active()
            except _StageDone as done:  # in the dtype the next stage's buffers hold
                handed = [(t.to(self.dtype), mesh.pipeline_next) for t in (done.hidden, done.text) if t is not None]
                sends += comm.exchange(handed, [], mesh, PIPEFUSION, tag="patch")
            self.busy_s += time.perf_counter() - started  # host seconds (on a GPU: launching, not running)
        if pipelined:
            return self.schedule.end_patch(sends, output)
        comm.wait(sends)
        if cache is not None and not per_patch:
            cache.end()
        if output is None:  # not the last stage: the prediction comes from there
            noise = first.new_empty(adapter.latents.prediction_shape(latents, self.model_config), dtype=self.dtype)
        else:  # the last patch's output: gather() filled one buffer with every patch's tokens
            noise = output[0] if isinstance(output, tuple) else output.sample
            noise = torch.stack(noise) if per_sample else noise  # one prediction per sample: sent stacked
            # the broadcast's dtype and layout, as the other stages allocated it (Sana's unpatchify returns a
            # permuted view, whose storage order a broadcast would send as it lies)
            noise = noise.to(self.dtype).contiguous()
        comm.broadcast(noise, mesh, PIPEFUSION, src_group_rank=self.config.pipefusion - 1, tag="noise")
        noise = list(noise.unbind(0)) if per_sample else noise
        self.step += 1
        if beside is not None:  # its prediction (LTX-2's audio's), the forward's second output, broadcast alike
            return self._beside_prediction(noise, output, bound.arguments)
        return (noise,) if not bound.arguments.get("return_dict", True) else Transformer2DModelOutput(sample=noise)

    def _beside_prediction(self, noise, output, arguments: dict):
        """The forward's outputs where the blocks carry a stream beside the image (adapter.BesideStream): the
        image's prediction, then the stream's, from the last stage's last patch (shaped as the stream's latents)."""
        if output is None:
            latents = arguments[self.state.adapter.beside.argument]
            prediction = latents.new_empty(latents.shape, dtype=self.dtype)
        else:
            prediction = output[1].to(self.dtype).contiguous()
        comm.broadcast(prediction, self.mesh, PIPEFUSION, src_group_rank=self.config.pipefusion - 1, tag="noise")
        return noise, prediction

    def _rebase_block_residuals(self, arguments: dict) -> None:
        """Each residual list the adapter declares (a ControlNet's), as this stage's blocks take them: the one
        each held block takes in the whole model, in the order held (adapter.BlockResiduals), in place."""
        adapter = self.state.adapter
        counts = dict(zip(adapter.block_lists, adapter.block_counts))
        for entry in adapter.block_residuals if self.state.controls.rebases_block_residuals else ():
            residuals = arguments.get(entry.argument)
            if residuals is None:
                continue
            held = [
                int(whole.rsplit(".", 1)[1])
                for whole in self.block_names.values()
                if whole.rsplit(".", 1)[0] == entry.block_list
            ]
            blocks = self.model_config.get(counts[entry.block_list]) or 0
            arguments[entry.argument] = entry.for_stage(residuals, held, blocks, arguments)

    def _begin_step(self, grid: tuple[int, int], appended: tuple) -> list[list[int]]:
        if self.grid != (grid, appended):  # a new image size: new patches, new buffers
            if self.schedule is not None and self.schedule.cursor:
                raise RuntimeError("the image size changed in the middle of a pipelined step")
            self.grid, self.buffers, self.indices, self.sums, self.edges = (grid, appended), {}, {}, {}, {}
            self.layout = self._patch_layout(grid, appended)
        patches = len(self.layout.patches)
        if self.step < self.config.warmup_steps:
            return [list(range(patches))]
        return [[self.schedule.cursor]] if self.pipelined else [[p] for p in range(patches)]

    def _patch_layout(self, grid: tuple[int, int], appended: tuple) -> PatchLayout:
        """The patches of a rows × cols token grid (and the appended grids), each over the sp ranks; the tokens
        the model pads the image with (Z-Image's, to a multiple of 32) go with the last patch, as they follow the
        last row."""
        padded = self.state.adapter.latents.padded_tokens(grid[0] * grid[1], self.model_config)
        return patch_layout(grid, self.config.patches, self.config.sp_degree, appended, padded=padded)

    decides_before_blocks = True  # a StepCache needs the first block over the whole image first

    def _set_active(self, active: list[int]) -> None:
        self.active = active

    def token_patches(self, tokens: int) -> list[tuple[int, int]]:
        """(patch, tokens) of this rank's tokens in the running forward, patch by patch."""
        sp_rank = self.mesh.group_rank(SP)
        return [(p, self.layout.chunk_len(p, sp_rank)) for p in self.active]

    # ---- the hooks -----------------------------------------------------------------------------------
    def _index(self, what: str, device) -> torch.Tensor:
        """This rank's token positions ("shard") or the all-gather's order ("gather") for the active
        patches, made once per layout on the device (a host-to-device copy per patch blocks)."""
        key = (what, tuple(self.active), device)
        if key not in self.indices:
            index = (
                self.layout.rank_tokens(self.active, self.mesh.group_rank(SP))
                if what == "shard"
                else self.layout.gather_order(self.active)
            )
            self.indices[key] = index.to(device)
        return self.indices[key]

    def shard(self, tokens):
        if self.state.adapter.grid_at_shard:  # Wan: [B, C, F, H, W] -> the active patches' [B, C, n]
            self.state.image_len = tokens[0, 0].numel()
            return tokens.flatten(2).index_select(2, self._index("shard", tokens.device))
        text = self.state.text_len if self.state.adapter.text_before_image_at_shard else 0
        self.state.image_len = tokens.shape[1] - text
        image = tokens[:, text:].index_select(1, self._index("shard", tokens.device))
        return torch.cat([tokens[:, :text], image], dim=1) if text else image

    def shard_text(self, text):
        """A stage keeps the joint text whole (text_shard_at None: no hook asks)."""
        return text

    def keep_tokens(self, tensor, dim: int):
        """The entries of the active patches' tokens of this rank, of a tensor with one per image token."""
        return tensor.index_select(dim, self._index("shard", tensor.device))

    def keep_prefix(self, count: int) -> int:
        """How many of this rank's tokens of the active patches are among the sequence's first `count`
        (its tokens run in ascending order, so they are the first ones it holds)."""
        if self.layout.order is not None:  # patches of several images: a rank's tokens are not in sequence order
            raise NotImplementedError(
                "a count of the sequence's first tokens (a per-token prefix) with images after the drawn one: "
                "PipeFusion's patches hold their tokens out of sequence order; run it under ulysses, ring, cfg or dp"
            )
        sp_rank = self.mesh.group_rank(SP)
        return sum(
            max(min(stop, count) - start, 0) for start, stop in (self.layout.chunk(p, sp_rank) for p in self.active)
        )

    def shard_rotary(self, tables):
        """The rotary tables' rows of this rank's tokens of the active patches, and every text row."""
        return self.state.adapter.rotary.keep_rows(
            tables, self.state.text_len, lambda t, dim: t.index_select(dim, self._index("shard", t.device))
        )

    def gather(self, tokens):
        """The active patches' tokens, gathered over sp into this step's output buffer: after the last
        patch it holds the whole image, and the model's own unpatchify turns it into the prediction."""
        sizes = self.layout.rank_sizes(self.active)
        if self.state.adapter.text_after_image_at_gather:  # Z-Image's [image; text]: the image's tokens alone
            tokens = tokens[:, : sizes[self.mesh.group_rank(SP)]]
        gathered = comm.all_gather(tokens.contiguous(), self.mesh, SP, dim=1, sizes=sizes, tag="tokens")
        if self.output is None or self.output.shape[0] != tokens.shape[0]:
            self.output = tokens.new_empty(tokens.shape[0], self.state.image_len, tokens.shape[2])
        self.output[:, self._index("gather", tokens.device)] = gathered
        return self.output

    def attend(self, kind, name, query, key, value, scale, text, image_len, text_mask=None):
        if kind == "whole_queries":
            return self._attend_whole_queries(name, query, key, value, scale)
        if kind not in STALE_KINDS:
            raise NotImplementedError(f"PipeFusion handles self and joint attention, not {kind}")
        if name not in self.buffers:
            self.buffers[name] = self.state.controls.buffer_type(
                self.layout, self.mesh.group_size(ULYSSES), self.mesh.group_rank(RING)
            )
        (q, k, v), joint = split_text(kind, text, query, key, value)
        out, joint_out = stale_attention(
            q,
            k,
            v,
            self.mesh,
            self.buffers[name],
            self.active,
            self.step,
            joint=joint,
            joint_mask=text_mask,
            scale=scale,
        )
        return join_text(kind, out, joint_out)

    def _attend_whole_queries(self, name, query, key, value, scale):
        """Queries whole on every rank of the stage (LTX-2's audio, handed on with each patch) over every patch's
        image K/V: the active patches' fresh, the others' as the buffer keeps them (this step's for the patches
        before, the step before's for those after), each sp rank holding its own tokens of every patch (no
        all-to-all: the queries are whole), the partial outputs merged over sp as under sequence shards."""
        if name not in self.buffers:  # one source (this rank's tokens), as a ring rank's buffer of one
            self.buffers[name] = self.state.controls.buffer_type(self.layout, 1, self.mesh.group_rank(SP))
        self.buffers[name].write(key, value, self.active, self.step)
        keys, values = self.buffers[name].read(self.active, self.step)
        return whole_query_attention(query, keys, values, self.mesh, scale=scale)

    # ---- linear attention's sums and a convolution's halo rows, kept per patch like K/V (Sana) ----------------
    # A warm-up step holds the whole image: it keeps each patch's sums and each patch's edge rows of every
    # convolving module's input. A patch step then attends with its own fresh sums plus the others' kept ones,
    # and convolves with the row above from the patch before it (this step's: the patches run in order) and the
    # row below from the patch after it (the step before's), as its attention reads stale K/V.
    def _patch_rows(self, width: int) -> list[tuple[int, int]]:
        """(first row, end row) of each patch, patches being bands of whole token rows."""
        return [(start // width, stop // width) for start, stop in self.layout.patches]

    def _holds_whole_image(self) -> bool:
        return len(self.active) == len(self.layout.patches)

    def linear_sums(self, name: str, key, value):
        """The whole image's linear-attention sums: in a warm-up step this rank's own (it holds every token),
        each patch's kept; in a patch step the patch's fresh sums and the other patches' kept ones."""
        if self._holds_whole_image():
            kept = torch.stack([linear_sums(key[:, :, a:b], value[..., a:b]) for a, b in self.layout.patches])
            self.sums[name] = kept
            return kept.sum(0)
        (patch,), fresh = self.active, linear_sums(key, value)
        # before any warm-up (warmup_steps=0) a patch not run yet counts as zeros, as StaleKV's buffers do
        kept = self.sums.setdefault(name, fresh.new_zeros((len(self.layout.patches), *fresh.shape)))
        others = [kept[q] for q in range(len(kept)) if q != patch]
        kept[patch] = fresh
        return fresh + torch.stack(others).sum(0)

    def token_rows(self, height: int, width: int) -> int:
        """The rows of the active patches (whole bands: sp = 1 within a stage)."""
        rows = self._patch_rows(width)
        return sum(rows[p][1] - rows[p][0] for p in self.active)

    def halo_sizes(self, reach: int) -> tuple[int, int]:
        if self._holds_whole_image():
            return 0, 0  # the convolution's own zero padding at both edges, as in the whole image
        (patch,) = self.active
        return (reach if patch > 0 else 0), (reach if patch < len(self.layout.patches) - 1 else 0)

    def halo(self, name: str, x, reach: int):
        """x[B, C, h, W], the active patches' rows of the module's input, with the kept rows around them."""
        rows = self._patch_rows(x.shape[3])
        if self._holds_whole_image():
            self.edges[name] = torch.stack(
                [torch.stack([x[:, :, a : a + reach], x[:, :, b - reach : b]]) for a, b in rows]
            )  # [patches, 2 (first rows, last rows), B, C, reach, W]
            return x
        (patch,), shape = self.active, (len(rows), 2, *x.shape[:2], reach, x.shape[3])
        edges = self.edges.setdefault(name, x.new_zeros(shape))  # zeros for rows not computed yet, as above
        above = [edges[patch - 1, 1]] if patch > 0 else []
        below = [edges[patch + 1, 0]] if patch < len(rows) - 1 else []
        edges[patch, 0], edges[patch, 1] = x[:, :, :reach], x[:, :, -reach:]
        return torch.cat([*above, x, *below], dim=2)

    def _take_incoming(self, _module, args, kwargs):
        """The stage's first block takes the previous stage's image (and text) states; a block that
        takes them joined takes [text; image] (Flux.2's single-stream blocks) or [image; text] (Z-Image's main
        layers) as its hidden states."""
        meta, args, kwargs = self.first_block, list(args), dict(kwargs)
        if self.first_joined:
            image, text = self.incoming
            hidden = kwargs.pop(meta.hidden_states_argument_name, None)
            last = self.state.adapter.joined_text_last
            if text is None:  # the forward joined its own text here (FamilyAdapter.text_joined_at): it stays
                hidden, n = args[0] if hidden is None else hidden, self.state.text_len
                text = hidden[:, hidden.shape[1] - n :] if last else hidden[:, :n]
            return (torch.cat([image, text] if last else [text, image], dim=1), *args[1:]), kwargs
        names = (meta.hidden_states_argument_name, meta.encoder_hidden_states_argument_name)
        for position, (name, value) in enumerate(zip(names, self.incoming)):
            if value is None:
                continue
            if name in kwargs or len(args) <= position:
                kwargs[name] = value
            else:
                args[position] = value
        return tuple(args), kwargs

    def _hand_over(self, _module, _args, output):
        meta = self.last_block
        if self.last_joined:  # [text; image] or [image; text] in one tensor: handed on as the two, like any stage's
            text = self.state.text_len
            if self.state.adapter.joined_text_last:
                raise _StageDone(output[:, : output.shape[1] - text], output[:, output.shape[1] - text :])
            raise _StageDone(output[:, text:], output[:, :text])
        if not isinstance(output, tuple):
            raise _StageDone(self._with_residual(output), None)
        text_at = meta.return_encoder_hidden_states_index
        image = self._with_residual(output[meta.return_hidden_states_index])
        raise _StageDone(image, None if text_at is None else output[text_at])

    def _with_residual(self, image):
        """The last block's image states as the forward goes on with them: plus the residual it adds after that
        block (a ControlNet's), which a stage that hands over at the block's output would otherwise drop."""
        return image if self.handed_residual is None else image + self.handed_residual

    def _last_block_residual(self, arguments: dict):
        """The residual the forward adds after this stage's last block (a ControlNet's, from the rebased and cut
        list of that block's list), or None: none declared, none given, or the last stage (it hands nothing over)."""
        if self.mesh.is_last_stage:
            return None
        last_list = list(self.block_names.values())[-1].rsplit(".", 1)[0]
        for entry in self.state.adapter.block_residuals:
            residuals = arguments.get(entry.argument)
            if entry.block_list == last_list and residuals:
                return residuals[-1]
        return None

    def _staleness(self) -> dict:
        """Small summary for views: per layer of this stage (named as in the whole model, in the
        forward's order), the step that wrote each patch and what attention read in the latest step
        (StaleKV.reads)."""

        def whole(name):  # "transformer_blocks.0.attn" on a stage holding block 3 -> "transformer_blocks.3.attn"
            block_list, index, rest = name.split(".", 2)
            return f"{self.block_names.get(f'{block_list}.{index}', f'{block_list}.{index}')}.{rest}"

        return dict(
            stage=self.mesh.coords[PIPEFUSION],
            blocks=self.blocks,
            step=self.step,
            patches=patch_ranges(*self.grid[0], self.config.patches) if self.layout else None,  # the drawn image's
            written_step={whole(name): list(buffer.written_step) for name, buffer in self.buffers.items()},
            reads={
                whole(name): [(step, list(active), list(steps)) for step, active, steps in buffer.reads]
                for name, buffer in self.buffers.items()
            },
            buffer=", ".join(sorted({type(b).__name__ for b in self.buffers.values()})) or None,
        )
