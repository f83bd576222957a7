"""parallelize: run a diffusers DiT under data, CFG, sequence, pipeline and tensor parallelism, unchanged.

    transformer = parallelize(transformer, ParallelConfig(cfg=2, ulysses=2))
    transformer(**inputs)          # every rank returns the same, full output

The family adapter (xdit_lab/families/<family>.py) says where to take over; hooks.py installs the hooks; the token
strategy decides what each rank holds: sequence shards (sequence.py) or, with pipefusion > 1, a
PipeFusion stage (pipefusion/); with tp > 1 the linear layers are split first (tensor_parallel.py). Weights are
not copied (a tp rank keeps its slices of them); the module keeps its forward signature. Every hook and replaced
forward is kept by name (`parallel_state(t).hooks`): `unparallelize(t)` removes them (a tp split is refused).
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from ..accelerations import StepCache, compile_backend, is_diffusers_cache, option_problems
from ..config import PIPEFUSION, TP, ParallelConfig, ParallelConfigError
from ..families import adapter_for, check_diffusers_version
from ..families.adapter import RankLocal
from ..families.tp_plan import QUANTIZED_SPLIT
from ..mesh import RankMesh
from .cache import apply_step_cache
from .dbcache import apply_dbcache
from .diffusers_cache import DiffusersCache, refuse_foreign_cache
from .hooks import (
    STATE_ATTRIBUTE,
    ParallelState,
    gather_batch,
    install_hooks,
    parallel_state,
    run_forward,
    split_batch,
)
from .offload import OFFLOADED
from .pipefusion import PipeFusionStage
from .sequence import SequenceShards
from .sharded_weights import shard_transformer
from .strategy import Controls
from .teacache import apply_teacache
from .tensor_parallel import apply_tensor_parallel
from .tensor_parallel import problems as tp_problems


def parallelize(
    transformer: torch.nn.Module,
    config: ParallelConfig,
    mesh: RankMesh | None = None,
    *,
    cache=None,
    compile: bool | str = False,
    shard_weights: bool = False,
    controls: Controls | None = None,
):
    """Make `transformer` (a diffusers DiT) run under `config` on this rank; returns it.

    Call it on every rank after init_distributed. Every rank returns the same full output.
    `cache` skips the blocks after the first at steps where the first one barely changed
    (cache.py); one transformer call is one step, and `parallel_state(t).reset()` starts over.
    A diffusers cache configuration (FirstBlockCacheConfig, TaylorSeerCacheConfig, MagCacheConfig,
    PyramidAttentionBroadcastConfig, SeaCacheConfig, FasterCacheConfig) runs diffusers' own hooks with one
    decision for every rank (diffusers_cache.py); a session step opens their cache context. One enabled by hand
    (transformer.enable_cache) is refused here and at the next forward.
    `compile=True` compiles the parallel forward with torch.compile, whole: one graph, in which each
    attention's parallel kernel and each gather is one operator that runs (and is recorded) as in
    eager. A compiled model runs under torch.no_grad (inference only). A string names torch.compile's
    backend instead of its default (inductor): "aot_eager" traces the same graph without generating kernels,
    for checking graph breaks and recompiles in seconds rather than minutes.
    `shard_weights=True` shards the blocks, then the rest, over the ranks that hold the same weights
    with torch's FSDP2 (sharded_weights.py): each rank keeps 1/N of them, and each block is gathered
    just before it runs; `parallel_state(t).weights` says what was sharded (nothing on a group of one).
    With compile=True too, FSDP2's gathers run eagerly between compiled pieces (torch marks its hooks
    as not traceable): exact and recorded alike, but in several graphs (a break at every block) rather than one.
    `controls` (models/strategy.py) are deliberately wrong variants for this model alone, which tests and
    lessons give to show that a bound catches them; by default none.

    Under `config.tp` > 1 the planned linear layers are split over the tp group first (tensor_parallel.py), before
    the token strategy's hooks and the batch's: every later step sees the layers as each rank holds them, and the
    sequence shards' attention attends this rank's heads. Under PipeFusion the stage keeps its blocks first, and tp
    splits those: a stage's rank of each tp coordinate hands its patches to the next stage's rank of the same
    coordinate and keeps the stale K/V of its own heads. compile takes tp as one graph (tp's all-reduces and gathers
    are opaque operators, recorded as they run: comm.all_reduce); shard_weights shards each rank's tp slices over
    its weights group (FSDP2 on a [weights, tp] DeviceMesh: RankMesh.device_mesh). Not composed with tp yet, and
    refused by name: quantized weights, PipeFusion's async schedule, and a cache under PipeFusion."""
    check_diffusers_version()
    adapter = adapter_for(transformer)
    if parallel_state(transformer) is not None:
        raise ValueError(
            f"this {type(transformer).__name__} is already parallelized; unparallelize it first, or build or load "
            f"a fresh one"
        )
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in transformer.modules()):
        raise ValueError(
            f"this {type(transformer).__name__} was sharded with fully_shard before parallelize: parallelize the "
            f"whole model first, then shard it (parallelize(..., shard_weights=True))"
        )
    refuse_foreign_cache(transformer)
    unsupported = option_problems(config, adapter, cache=cache, compile=compile)
    if unsupported:
        raise unsupported[0][1]("; ".join(sentence for sentence, _ in unsupported))
    if getattr(config, PIPEFUSION) > 1 and adapter.pipefusion_refused:
        raise ParallelConfigError(f"PipeFusion is not offered on {adapter.family} yet: {adapter.pipefusion_refused}")
    if getattr(config, TP) > 1:
        _refuse_with_tp(transformer, adapter, config)
    backend = compile_backend(compile) if compile else None
    model_config = transformer.config
    config.validate(
        num_heads=adapter.attention_shape(model_config)[0],
        num_layers=adapter.num_blocks(model_config),
        seq_len=adapter.latents.default_image_tokens(model_config),
    )
    owns_mesh = mesh is None
    mesh = mesh or RankMesh(config)
    if mesh.config != config:
        raise ValueError(f"mesh was built for {mesh.config.short()}, not {config.short()}")
    if not mesh.active:
        raise ValueError(
            f"rank {mesh.rank} is idle in {config.short()} ({config.world_size} of {mesh.world_size} "
            f"ranks): only ranks with mesh.active run the model"
        )

    state = ParallelState(adapter, mesh, controls or Controls())
    state.owns_mesh = owns_mesh
    # a PipeFusion stage drops the other stages' blocks first, so that tp splits the blocks this rank runs; then the
    # split, before any other hook: every hook after it sees the layers as this rank holds them
    if getattr(config, PIPEFUSION) > 1:
        state.strategy = PipeFusionStage.apply(transformer, state, config)
    if getattr(config, TP) > 1:
        state.tensor = apply_tensor_parallel(transformer, state)
    if getattr(config, PIPEFUSION) == 1:
        state.strategy = SequenceShards(state)
    if isinstance(cache, StepCache):
        apply = dict(teacache=apply_teacache, dbcache=apply_dbcache).get(cache.method, apply_step_cache)
        state.cache = apply(transformer, state, cache)
    install_hooks(transformer, state)
    state.hooks.replace("parallel_forward", transformer, forward=_parallel_forward(transformer, state))
    if is_diffusers_cache(cache):  # diffusers' hooks around the forwards ours run (models/diffusers_cache.py)
        state.cache = DiffusersCache(transformer, state, cache)
    if shard_weights:  # after the hooks: FSDP2 gathers before them and frees after them
        state.weights = shard_transformer(transformer, state)
    if compile:
        state.hooks.replace("compile", transformer, forward=_compiled(transformer.forward, backend))
    return transformer


def unparallelize(transformer: torch.nn.Module) -> torch.nn.Module:
    """Undo `parallelize` on this rank (call it on every rank of the mesh); returns the module.

    Every hook and replaced forward listed in `parallel_state(transformer).hooks` is removed (the
    attention processors run diffusers' attention again), the parallel state is dropped, and
    `parallelize` may be called on the module again. The mesh's process groups are closed here only
    if parallelize made the mesh (no `mesh=` given); a mesh passed in (load_pipeline's, a Lab's, your
    own) belongs to whoever made it, who closes it (RankMesh.close) once nothing else runs on it.
    A PipeFusion stage stays a stage: parallelize dropped the other stages' blocks to free their memory,
    and they do not come back; the module runs its own blocks serially, and parallelize takes it again
    as the same stage. Weights sharded with shard_weights=True are refused: FSDP2 changed the modules'
    classes, which cannot be undone; load the model again. So is a model offloaded after parallelize
    (offload_blocks: diffusers' hooks wrap the parallel forward)."""
    state = parallel_state(transformer)
    if state is None:
        raise ValueError(f"this {type(transformer).__name__} is not parallelized")
    if state.tensor is not None:
        raise ValueError(
            f"this {type(transformer).__name__}'s layers were split over tp {state.tensor.degree} ranks (DTensor), "
            f"which is not undone; build or load a fresh one"
        )
    if state.weights is not None and state.weights.sharded:
        raise ValueError(
            f"this {type(transformer).__name__}'s weights were sharded (shard_weights=True), which cannot be "
            f"undone; build or load a fresh one"
        )
    if getattr(transformer, OFFLOADED, None):  # diffusers' hooks wrap the parallel forward: removing it drops theirs
        raise ValueError(
            f"this {type(transformer).__name__}'s blocks were offloaded after it was parallelized (offload_blocks), "
            f"whose hooks wrap the parallel forward; load it again without offload_blocks to run it serially"
        )
    if isinstance(state.cache, DiffusersCache):  # diffusers' hooks wrap forwards ours replaced: they go first
        state.cache.remove()
    state.hooks.remove_all()
    delattr(transformer, STATE_ATTRIBUTE)
    if state.owns_mesh:
        state.mesh.close()
    return transformer


def _refuse_with_tp(transformer, adapter, config) -> None:
    """What tensor parallelism is not composed with yet, refused by name before anything is split (and a family
    without a plan: model_plan names it)."""
    widths = tp_problems(transformer, adapter, config.tp)  # the plan, and the widths tp must divide
    if widths:
        raise ParallelConfigError("; ".join(widths))
    name = type(transformer).__name__
    from ..quantization import quantized_form

    quantized = next((n for n, p in transformer.named_parameters() if quantized_form(p) is not None), None)
    if quantized is not None:
        raise ValueError(
            f"{name}'s weights are quantized ({quantized}: {quantized_form(transformer.get_parameter(quantized))}), "
            f"which tp {config.tp} does not split yet: {QUANTIZED_SPLIT}; load it unquantized for tp, or quantized "
            f"with tp 1"
        )


def _compiled(forward, backend: str):
    """torch.compile of the whole parallel forward, called without autograd (the parallel operators
    have no backward)."""
    compiled = torch.compile(forward, backend=backend)

    @functools.wraps(forward)
    def compiled_forward(*args, **kwargs):
        with torch.no_grad():
            return compiled(*args, **kwargs)

    return compiled_forward


def _parallel_forward(transformer, state):
    """The forward that replaces the module's: split the batch, let the strategy run the model's own
    forward, gather the batch. It holds the module weakly: a module replaced by a reconfigure is
    freed as soon as its last user lets go (no cycle through its own forward attribute)."""
    signature = inspect.signature(transformer.forward)
    owner = weakref.ref(transformer)
    if "forward" in vars(transformer):  # someone else's forward already on the instance: keep it as it is
        instance_forward = transformer.forward
        own_forward, get_forward = instance_forward, lambda: instance_forward
    else:
        module, own_forward = weakref.ref(transformer), type(transformer).forward
        get_forward = lambda: functools.partial(own_forward, module())  # noqa: E731

    @functools.wraps(own_forward)
    def parallel_forward(*args, **kwargs):
        refuse_foreign_cache(owner())
        bound = signature.bind(*args, **kwargs)
        dp_sizes = split_batch(state, bound.arguments)
        forward = get_forward()
        if state.cache is not None:
            residuals = any(bound.arguments.get(entry.argument) is not None for entry in state.adapter.block_residuals)
            state.cache.begin(bound.arguments["hidden_states"], block_residuals=residuals)
        output = state.strategy.forward(lambda: run_forward(state, forward, bound), bound)
        if state.adapter.gather_at is None:  # a ControlNet: its residual lists stay this rank's
            return _rank_local(output)
        return gather_batch(state, output, dp_sizes)

    return parallel_forward


def _rank_local(output):
    """A ControlNet's output (a tuple, or diffusers' output dataclass) with each list of residuals marked
    RankLocal: this rank's rows and tokens, which the base transformer on the same mesh takes as they are."""
    if isinstance(output, tuple):
        return tuple(None if part is None else RankLocal(part) for part in output)
    for key, part in output.items():
        output[key] = RankLocal(part)
    return output
