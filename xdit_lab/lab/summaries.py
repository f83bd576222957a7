"""rank_summary: what one rank holds and moved, as a small picklable dict for the views.

Called on every rank (a Lab engine, or a torchrun process) after any step of a DenoiseSession.
Everything is read from the objects that own it (the mesh, ParallelState, the PipeFusion stage,
the session's comm log); nothing large travels: lists of ints, floats and strings only.

    summary = rank_summary(session)
    summary["shard"]["tokens"]      # [[start, stop), ...] image tokens this rank computes
    summary["comm"]["measured"][-1] # bytes out of this rank per group, last step
    traffic.expected_bytes_per_step(summary) == summary["comm"]["measured"][-1]   # the closed forms

Keys (exact): rank, mesh, coords, device, family, config, step, num_steps, timestep, grid,
image_tokens, shapes, shard, batch, staleness, memory, cache, decode, comm. See rank_summary's docstring.
"""

from __future__ import annotations

import dataclasses

from ..mesh import CFG, DP
from ..models import kept_block_names, local_mixing_layers, other_traffic_sizes, parallel_state
from ..models.sharded_weights import local_parameter_bytes
from ..models.tensor_parallel import tp_shapes
from ..plan.loaded import held_bytes, rank_memory
from ..sharding import batch_rows
from ..traffic import expected_bytes_per_step
from ..vae import DECODED
from .held import component_holdings, plan_terms


def rank_summary(session) -> dict:
    """This rank's picture after the session's last step (or before the first: comm is then empty).

    rank, mesh (str), coords {dp, cfg, pipefusion, ring, ulysses}, device, family, config (the
    ParallelConfig's fields), step (steps done), num_steps, timestep (of the last step done, or
    None), grid [rows, cols] of image tokens, image_tokens, shapes (what expected_bytes_per_step
    needs), shard, batch, staleness (None without PipeFusion), memory (parameter bytes per component;
    `components`: each as this rank holds it, sharded or whole, on the device or the host, and
    `weight_gather_bytes`, from the modules (lab/held.py); `plan`: the load's plan beside), cache (None without a
    StepCache: threshold, skips, changes, local_changes, seconds per step), decode (None before
    result(): the rows and images this rank decoded, bytes per group:tag, the halo closed form), comm {measured, expected}:
    one {group: bytes out of this rank} per step done."""
    pipe, mesh, config = session.pipe, session.pipe.mesh, session.pipe.config
    transformer = pipe.diffusers_pipeline.transformer
    state = parallel_state(transformer)
    rows, cols = token_grid(session)
    appended = session.recipe.appended_grids(pipe.diffusers_pipeline, session.request)  # an edit's references
    step = session.step_index
    report = state.strategy.report(grid=(rows, cols), appended=appended)
    summary = dict(
        rank=mesh.rank,
        mesh=str(mesh),
        coords=dict(mesh.coords),
        device=str(pipe.device),
        family=state.adapter.family,
        config=dataclasses.asdict(config),
        step=step,
        num_steps=session.num_steps,
        experts=list(session.step_experts),  # which of the pipeline's transformers ran each step (Wan 2.2 A14B's two)
        timestep=float(session.prepared.timesteps[step - 1]) if step else None,
        grid=[rows, cols],
        image_tokens=rows * cols,
        shapes=_shapes(session, transformer, state, report, rows, cols),
        shard=report.tokens,
        batch=_batch(session, state),
        staleness=_staleness(report.staleness),
        memory=_memory(pipe, session, report),
        cache=_cache(session, state),
        encode=dict(prompts=list(session.own_prompts), bytes=dict(session.comm_encode)),
        decode=_decode(session),
    )
    measured = [dict(step_bytes) for step_bytes in session.comm_per_step]
    cache = summary["cache"] or {}
    expected = [
        expected_bytes_per_step(
            config,
            summary["shapes"],
            coords=summary["coords"],
            step=i,
            cache_skips=cache.get("skips"),
            experts=summary["experts"],
            cache_method=cache.get("method"),
        )
        for i in range(len(measured))
    ]
    summary["comm"] = dict(measured=measured, expected=expected)
    return summary


def _cache(session, state) -> dict | None:
    """The StepCache's threshold and, per step done, whether it skipped, the change it measured, the change this
    rank's tokens alone gave (Wan 2.2 A14B's two transformers each keep a state of their own, whose calls are its
    steps in order: the summary's `experts` says which ran each step)."""
    if state.cache is None:
        return None
    caches = [parallel_state(t).cache for t in session.recipe.transformers(session.pipe.diffusers_pipeline)]
    local = [cache.local_changes for cache in caches]
    calls = [0] * len(caches)
    local_changes = []
    for expert in session.step_experts:
        local_changes.append(local[expert][calls[expert]])
        calls[expert] += 1
    return dict(
        threshold=getattr(state.cache.settings, "threshold", None),  # a StepCache's, or diffusers' config's
        method=_method(state.cache.settings),
        skips=list(session.cache_skips),
        changes=list(session.cache_changes),
        local_changes=local_changes,
        seconds=list(session.timings.steps),
    )


def _decode(session) -> dict | None:
    """After result(): bytes out of this rank in the decode per group:tag, and what the parallel
    decode recorded of itself (rows and images this rank decoded, the halo closed form); None
    before the decode. `parallel` is False where every rank decoded the whole batch."""
    if session.comm_decode is None:
        return None
    decoded = getattr(session.pipe.diffusers_pipeline.vae, DECODED, None)
    return dict(
        parallel=decoded is not None,
        **(decoded or {}),
        bytes={f"{group}:{tag}": n for (group, tag), n in session.comm_decode.items()},
    )


def token_grid(session) -> tuple[int, int]:
    """(rows, cols) of image tokens, as the family's latent layout orders them (a video's frames stacked
    as rows). Packed tokens (Flux) carry no grid: rows from the image height and the size a token covers."""
    latents, transformer = session.latents, session.pipe.diffusers_pipeline.transformer
    layout = parallel_state(transformer).adapter.latents
    if layout.name != "tokens":
        return layout.token_grid(latents, transformer.config, {})
    multiple = session.recipe.size_multiple(session.pipe.diffusers_pipeline)[0]
    rows = session.prepared.extra["size"][0] // multiple
    return rows, latents.shape[1] // rows


def _controlnet_layers(session) -> dict:
    """A ControlNet's sequence-parallel attention layers (FluxControlNetPipeline, StableDiffusion3ControlNetPipeline):
    they run each step beside the transformer's, over the same tokens, text and heads."""
    controlnet = getattr(session.pipe.diffusers_pipeline, "controlnet", None)
    if controlnet is None or parallel_state(controlnet) is None:  # none, or whole on every rank (PipeFusion)
        return dict(controlnet_self_layers=0, controlnet_joint_layers=0)
    kinds = [parallel_state(controlnet).adapter.attention_kind(name) for name, _ in controlnet.named_modules()]
    return dict(
        controlnet_self_layers=kinds.count("self"),
        controlnet_joint_layers=sum(1 for k in kinds if k and k.startswith("joint")),
    )


def _tensor_parallel(session, transformer, state) -> dict:
    """A model split over tp ranks: its split layers (tensor_parallel.tp_shapes), and a cross attention's text."""
    if state.tensor is None:
        return {}
    text = session.prepared.conditioning.get("encoder_hidden_states")
    shapes = tp_shapes(transformer, state.tensor, state.adapter)
    return dict(tp=shapes, cross_text_len=0 if text is None else text.shape[1])


def _shapes(session, transformer, state, report, rows, cols) -> dict:
    """Sizes the communication formulas need, read from the model this rank holds."""
    named_kinds = [(name, state.adapter.attention_kind(name)) for name, _ in transformer.named_modules()]
    kinds = [kind for _, kind in named_kinds]
    # attention layers of the blocks a StepCache runs at a skipped step: the first block (DBCache: front and back)
    kept = tuple(kept_block_names(transformer, state))
    first = [k for n, k in named_kinds if n.startswith(kept)] if kept else []
    gather, inner = transformer.get_submodule(state.adapter.gather_at), session.pipe.diffusers_pipeline
    config = transformer.config
    heads, head_dim = state.adapter.attention_shape(config)
    return dict(
        batch=session.latents.shape[0] * (2 if session.prepared.do_cfg else 1),  # [uncond; cond] rows
        rows=rows,
        cols=cols,
        appended_tokens=session.recipe.appended_tokens(session.prepared),  # beyond the grid: Kontext's reference
        # the grids among them that PipeFusion cuts into bands with the drawn one (Qwen-Image-Edit's references)
        appended_grids=[list(grid) for grid in session.recipe.appended_grids(inner, session.request)],
        padded_tokens=state.adapter.latents.padded_tokens(rows * cols, config),  # Z-Image's, to a multiple of 32
        heads=heads,
        head_dim=head_dim,
        self_layers=kinds.count("self"),  # this rank's sequence-parallel attention layers (a stage: its own)
        joint_layers=sum(1 for k in kinds if k and k.startswith("joint")),
        first_block_self_layers=first.count("self"),
        **local_mixing_layers(state.adapter, transformer),
        **other_traffic_sizes(state.adapter, transformer),  # LTX-2's audio: its whole queries, its output
        first_block_joint_layers=sum(1 for k in first if k and k.startswith("joint")),
        # a ControlNet's (FluxControlNetPipeline): its joint layers run each step beside the transformer's, over the
        # same tokens, text and heads
        **_controlnet_layers(session),
        text_len=state.text_len,  # text tokens of the last forward
        # whether sequence shards split the joint text (Z-Image's stays whole: its forward joins it to the image)
        text_sharded=state.strategy.text_shard_at is not None,
        # where the text sits in attention: before or after the image tokens in one joint attention,
        # or apart, as the K/V of a cross-attention (None: no text)
        text_at="first"
        if "joint_first" in kinds
        else "last"
        if "joint_last" in kinds
        else "cross"
        if "cross" in kinds
        else None,
        # PipeFusion: a stage hands on the text states with each patch where its blocks change them (SD3, Flux, ...)
        handed_text=report.hands_text,
        proj_width=gather.out_features,  # features per token where tokens are gathered (before unpatchify)
        dtype_bytes=next(transformer.parameters()).element_size(),
        # the async PipeFusion schedule sends latents back to stage 0: their size, and the last step
        latent_rows=session.latents.shape[0],
        latent_elements=session.latents[0].numel(),
        latent_bytes=session.latents.element_size(),
        steps=session.num_steps,
        **_tensor_parallel(session, transformer, state),
    )


def _batch(session, state) -> dict:
    """Rows of the model's batch [uncond; cond] this rank computes, by the forward's own split
    (sharding.batch_rows, which split_batch calls)."""
    total = session.latents.shape[0] * (2 if session.prepared.do_cfg else 1)
    mesh = state.mesh
    cfg_half = mesh.group_rank(CFG) if mesh.config.cfg == 2 else None  # 0: unconditional, 1: conditional
    try:
        start, stop, dp_sizes = batch_rows(
            total, mesh.config.cfg, mesh.config.dp, mesh.group_rank(CFG), mesh.group_rank(DP)
        )
    except ValueError as error:  # cfg 2 without guidance: the forward would refuse too
        return dict(total=total, rows=None, stand_in=False, cfg_half=cfg_half, error=str(error))
    return dict(
        total=total,
        rows=list(range(start, stop)),
        stand_in=dp_sizes[mesh.group_rank(DP)] == 0,  # computed but dropped by the gather
        cfg_half=cfg_half,
        error=None,
    )


def _staleness(info: dict | None) -> dict | None:
    """Per attention layer of this stage: the step that last wrote each patch's K/V, and how old
    the K/V were that attention read in the last step, as the buffers recorded at each read.

    read_age[q][p]: age in steps of patch p's K/V when patch q attended in the last step (the
    step of the read minus the step that wrote the slice it read; None: a slice never written).
    A warmup step runs all patches at once; a pipelined step runs them one at a time, each
    writing its own K/V before it reads. age[p] = the oldest any patch read. Under Ring a rank
    records its own part of every patch (every ring rank writes its part on the same schedule).
    None where the strategy keeps no K/V between steps (sequence shards)."""
    if info is None:
        return None
    last = info["step"] - 1  # the diffusion step the buffers were last used in
    patches = len(info["patches"] or [])
    written, ages, reads, pipelined = {}, {}, {}, False
    for name, steps in info["written_step"].items():  # in the forward's order, named as in the whole model
        record = info["reads"][name]
        matrix = [[None] * patches for _ in range(patches)]
        for step, active, read_steps in record:
            for q in active:
                matrix[q] = [None if w is None else step - w for w in read_steps]
        pipelined = pipelined or any(len(active) < patches for _, active, _ in record)
        written[name], reads[name] = list(steps), matrix
        ages[name] = [max((row[p] for row in matrix if row[p] is not None), default=None) for p in range(patches)]
    return dict(
        stage=info["stage"],
        blocks=list(info["blocks"]),
        step=last,
        pipelined=pipelined,
        patches=[list(p) for p in info["patches"] or []],
        layers=list(written),
        written_step=written,
        age=ages,
        read_age=reads,
        buffer=info["buffer"],
    )


def _memory(pipe, session, report) -> dict:
    figures = rank_memory(pipe)
    params = figures.pop("parameter_bytes")
    total = figures.pop("parameter_total")
    transformer = pipe.diffusers_pipeline.transformer
    state = parallel_state(transformer)  # the blocks this rank holds, of every block list; a shard's own bytes
    blocks = sum(local_parameter_bytes(block) for block in state.adapter.blocks(transformer))
    kv = sum(report.kept_bytes.values())  # what the strategy keeps between steps (PipeFusion: stale K/V)
    components = component_holdings(pipe)  # each as this rank holds it: shards, buffers, on the host or not
    gathers = max((c["gather_bytes"] for c in components.values()), default=0)  # whole during a sharded forward
    if pipe.device.type == "cuda":  # the allocator's peak holds weights and buffers too: report what is above
        on_device = sum(c["device_bytes"] for c in components.values())  # an offloaded one's at most
        activations = max(0, figures["max_allocated"] - on_device - kv - gathers)
        source = "CUDA peak allocated − weights on the GPU − KV buffers" + (" − weight gathers" if gathers else "")
    else:  # no allocator peak on CPU: the tensors the session keeps between steps
        activations = held_bytes([session.prepared.latents, session.prepared.conditioning])
        source = "session latents + conditioning tensors (CPU)"
    return dict(
        parameter_bytes=params,
        parameter_total=total,
        transformer_block_bytes=blocks,
        kv_buffer_bytes=kv,
        activation_bytes=activations,
        activation_source=source,
        process=figures,
        components=components,
        weight_gather_bytes=gathers,
        plan=plan_terms(pipe.memory_plan),
    )


def _method(settings) -> str:
    """The cache's name in a summary: "StepCache", "StepCache(teacache)", or diffusers' configuration's class."""
    method = getattr(settings, "method", "first_block")
    return type(settings).__name__ + ("" if method == "first_block" else f"({method})")
