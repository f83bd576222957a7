"""The hook machinery every strategy shares: diffusers' model runs unchanged, and xdit_lab takes
over at the places the family adapter (xdit_lab/families/) names:

  1. the forward's inputs: the batch [uncond; cond] is split over the cfg group, then over dp
  2. the patch embedding's output: the strategy keeps this rank's tokens         strategy.shard
  3. rotary tables (Flux): the strategy keeps the rows of its tokens             strategy.shard_rotary
  4. every F.scaled_dot_product_attention call inside a known attention module:
     the strategy attends, told the module's kind (self, cross, joint)          strategy.attend
     (an attention module the adapter does not know is refused at parallelize time)
     diffusers can route a module's attention to other kernels (`set_attention_backend("flex")`,
     DIFFUSERS_ATTN_BACKEND) that never call it: the known modules are set back to diffusers'
     native backend here, and a known module whose attention did not reach us raises (it would
     have attended to its own shard only)
     under torch.compile (parallelize(..., compile=True)) the strategy's attention and each gather
     are one opaque operator each (xdit_lab::attend, xdit_lab::all_gather): the graph stays whole,
     and the collectives inside run and are recorded as in eager
  5. the last projection's output, before unpatchify: tokens come back whole    strategy.gather
     and the forward's output is gathered over dp and cfg, so every rank returns the full batch

How tokens are split is the strategy's alone: one contiguous shard per sequence-parallel rank
(sequence.py), or a PipeFusion stage's patches (pipefusion/). The hooks below never ask which.
`parallel_state(module)` is the one way to read what a parallelized module knows.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import comm
from ..mesh import CFG, DP
from ..sharding import batch_rows

log = logging.getLogger("xdit_lab.models")


class ParallelState:
    """What one parallelized module knows: its adapter, the mesh, the token strategy, and what the
    forward running now has seen (the text length, the whole image length, the attention module)."""

    def __init__(self, adapter, mesh):
        self.adapter, self.mesh = adapter, mesh
        self.handle = comm.handle(self)  # how a compiled graph's operators find this state
        self.strategy = None  # SequenceShards or PipeFusionStage, set by parallelize
        self.cache = None  # a FirstBlockCache when parallelize was given a StepCache
        self.weights = None  # a ShardedWeights when parallelize was asked to shard them (sharded_weights.py)
        self.stand_in = False  # this rank computes a dp stand-in row (it has no rows of its own)
        self.in_forward = False
        self.text_len = 0  # joint text tokens of the running forward
        self.image_len = None  # whole image tokens, set where they are sharded

    def reset(self) -> None:
        """A new generation: the strategy (PipeFusion warms up again) and the cache start over."""
        self.strategy.reset()
        if self.cache is not None:
            self.cache.reset()


STATE_ATTRIBUTE = "_xdit_lab_state"


def parallel_state(module) -> ParallelState | None:
    """The ParallelState of a module that `parallelize` made parallel, else None."""
    return getattr(module, STATE_ATTRIBUTE, None)


def install_hooks(transformer, state: ParallelState) -> None:
    """Shard, rotary and gather hooks at the adapter's places; attention modules marked by kind."""
    adapter = state.adapter
    _hook_output(transformer, adapter.shard_at, functools.partial(_when_running, state, "shard"))
    _hook_output(transformer, adapter.gather_at, functools.partial(_when_running, state, "gather"))
    if adapter.rotary_at:
        _hook_output(transformer, adapter.rotary_at, functools.partial(_when_running, state, "shard_rotary"))
    known, replaced = 0, {}
    for name, module in transformer.named_modules():
        kind = adapter.attention_kind(name)
        if kind is None:
            if name and hasattr(module, "processor"):
                raise TypeError(
                    f"attention module {name} ({type(module).__name__}) of {type(transformer).__name__} is not known "
                    f"to the {adapter.family} adapter: its tokens may be sharded, so it cannot run unchanged; "
                    f"extend the adapter (xdit_lab/families/<family>.py)"
                )
            continue
        known += 1
        backend = _use_native_attention(module)
        if backend is not None:
            replaced.setdefault(backend, []).append(name)
        module.forward = _intercepting_forward(module, state, kind, name)
    if not known:
        raise TypeError(
            f"no attention modules of {type(transformer).__name__} matched the {adapter.family} adapter; "
            f"this diffusers release may have renamed them"
        )
    for backend, names in replaced.items():
        log.warning(
            "%d attention modules of %s were set to diffusers' %r attention backend, which the parallel "
            "kernels cannot take over; they run diffusers' native backend now, and xdit_lab's kernels do "
            "the attention (see xdit_lab.attention.attention_backend)",
            len(names),
            type(transformer).__name__,
            backend,
        )
    setattr(transformer, STATE_ATTRIBUTE, state)


def _hook_output(root, path: str, fn):
    root.get_submodule(path).register_forward_hook(lambda _module, _inputs, output: fn(output))


def _when_running(state, method: str, value):
    """A hooked module also runs outside a parallel forward (e.g. a probe): leave it alone then."""
    return getattr(state.strategy, method)(value) if state.in_forward else value


def _use_native_attention(module) -> str | None:
    """Point a module's diffusers attention at the native backend, the one that calls
    F.scaled_dot_product_attention; return the backend it used before, if another.

    A processor's `_attention_backend` (diffusers 0.42's dispatch: Flux and newer families)
    wins when set; else the process-wide active backend applies, which DIFFUSERS_ATTN_BACKEND sets
    at import and `set_attention_backend` sets too. Processors without the attribute (PixArt,
    SD3, CogVideoX, DiT) call F.scaled_dot_product_attention themselves."""
    processor = getattr(module, "processor", None)
    if processor is None or not hasattr(processor, "_attention_backend"):
        return None
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    chosen = processor._attention_backend or _AttentionBackendRegistry._active_backend
    processor._attention_backend = AttentionBackendName.NATIVE
    chosen = AttentionBackendName(chosen).value
    return None if chosen == AttentionBackendName.NATIVE.value else chosen


def run_forward(state: ParallelState, forward, bound):
    """The model's own forward, with the hooks active (they leave a module alone outside it)."""
    text = bound.arguments.get("encoder_hidden_states")
    state.text_len = text.shape[1] if text is not None and text.dim() >= 2 else 0
    state.in_forward = True
    try:
        return forward(*bound.args, **bound.kwargs)
    finally:
        state.in_forward = False


# ---- attention: hand SDPA calls of known modules to the strategy -----------------------------------------


def _intercepting_forward(module, state, kind, name):
    """The attention module's own forward, with its F.scaled_dot_product_attention handed to the strategy.

    The interceptor is entered here, per module, and carries its own kind, rather than once around
    the whole forward reading a kind that hooks set on shared state: torch.compile traces a mode
    entered inside the graph (one graph, no breaks), but applies writes to Python objects only
    after the graph has run. The module is held weakly, so that it does not keep itself alive
    through its own forward attribute."""
    own_forward, module = type(module).forward, weakref.ref(module)

    def forward(*args, **kwargs):
        if not state.in_forward:  # e.g. a probe outside the parallel forward
            return own_forward(module(), *args, **kwargs)
        interceptor = AttentionInterceptor(state, kind, name)
        with interceptor:
            output = own_forward(module(), *args, **kwargs)
        if not interceptor.reached:
            processor = getattr(module(), "processor", None)
            backend = getattr(processor, "_attention_backend", None)
            raise RuntimeError(
                f"attention module {name} ({kind}) ran without calling F.scaled_dot_product_attention, so its "
                f"tokens were not handed to the sequence-parallel kernels and each rank would have attended to its "
                f"own shard only. Its processor is {type(processor).__name__}"
                f"{' with attention backend ' + repr(backend) if processor else ''}; keep diffusers' default "
                f"processors and native attention backend on a parallelized model"
            )
        return output

    return forward


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class AttentionInterceptor(TorchFunctionMode):
    """F.scaled_dot_product_attention inside one known attention module: cross-attention runs as it
    is (image queries against whole text keys are exact on a shard); self and joint go to the
    strategy. Under torch.compile the strategy runs as one opaque operator (`xdit_lab::attend`),
    so its collectives and their records run eagerly, exactly as without compile."""

    def __init__(self, state, kind: str, name: str):
        super().__init__()
        self.state, self.kind, self.name, self.reached = state, kind, name, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.unflatten:  # written in Python, it ends in super().unflatten, which
            return torch.unflatten(*args, **kwargs)  # torch.compile cannot trace inside a mode
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.reached = True
        if self.kind in ("cross", "text"):  # whole text K/V (or text alone) on every rank: exact as it is
            return func(*args, **kwargs)
        query, key, value, mask, dropout_p, is_causal, scale, _ = _sdpa_arguments(*args, **kwargs)
        if is_causal or dropout_p:
            raise NotImplementedError(f"{self.kind} attention that is causal or has dropout is not sequence-parallel")
        text_mask = None if mask is None else self._text_key_mask(mask, query)
        # The lengths travel as arguments: under compile, what the forward wrote on the state so far
        # reaches it only after the graph, while the operator runs inside it.
        lengths = self.state.text_len, self.state.image_len
        if torch.compiler.is_compiling():
            return torch.ops.xdit_lab.attend(
                query, key, value, self.state.handle, self.kind, self.name, scale, *lengths, text_mask
            )
        return self.state.strategy.attend(self.kind, self.name, query, key, value, scale, *lengths, text_mask)

    def _text_key_mask(self, mask, query):
        """[B, T] bool over the joint text keys, from the mask a family with padded text builds over all
        of its keys (Qwen-Image: [B, 1, 1, T + S], the image columns True by construction). Any other
        mask would mask image keys this rank does not hold: refused."""
        text, adapter = self.state.text_len, self.state.adapter
        keys = query.shape[2]  # [text; this rank's image tokens] (or [image; text])
        if not (
            adapter.text_key_mask
            and self.kind in ("joint_first", "joint_last")
            and text
            and mask.dtype == torch.bool
            and tuple(mask.shape) == (query.shape[0], 1, 1, keys)
        ):
            raise NotImplementedError(
                f"{self.name} ({self.kind} attention of {adapter.family}) passes an attention mask "
                f"({str(mask.dtype).replace('torch.', '')} {tuple(mask.shape)}); the parallel kernels take only a "
                f"padded-text key mask, [batch, 1, 1, text + image] bool, from families that declare one "
                f"(FamilyAdapter.text_key_mask)"
            )
        return mask[:, 0, 0, :text] if self.kind == "joint_first" else mask[:, 0, 0, keys - text :]


# forward arguments that address blocks by index (SD3's skip-layer guidance, ControlNet residuals)
PER_BLOCK_ARGUMENTS = (
    "skip_layers",
    "block_controlnet_hidden_states",
    "controlnet_block_samples",
    "controlnet_single_block_samples",
)


def refuse_per_block(arguments: dict) -> None:
    """Forward arguments a PipeFusion stage cannot take: the forward indexes them by its loop index,
    which a stage counts from its own first block."""
    per_block = [name for name in PER_BLOCK_ARGUMENTS if arguments.get(name) is not None]
    if per_block:
        raise NotImplementedError(
            f"{', '.join(per_block)} name blocks by their index in the whole model, which a PipeFusion stage "
            f"does not hold; run them without PipeFusion"
        )


def refuse_unsplittable(arguments: dict) -> None:
    """Forward arguments whose tokens no strategy can split yet (ulysses, ring and pipefusion must be 1):
    Flux.2's reference-image K/V cache, and a timestep per token (Wan 2.2 TI2V), whose embedding
    would need the tokens' shards."""
    if arguments.get("kv_cache_mode") is not None:
        raise NotImplementedError(
            "Flux.2's reference-image K/V cache (kv_cache_mode) is not sequence-parallel or pipelined yet; "
            "run it under cfg and dp only (ulysses = ring = pipefusion = 1)"
        )
    timestep = arguments.get("timestep")
    if isinstance(timestep, torch.Tensor) and timestep.dim() == 2:
        raise NotImplementedError(
            f"a timestep per token (shape {tuple(timestep.shape)}, e.g. Wan 2.2 TI2V) is not sequence-parallel or "
            f"pipelined yet: its embedding would need the tokens' shards; run it under cfg and dp only "
            f"(ulysses = ring = pipefusion = 1)"
        )


def split_text(kind: str, text: int, query, key, value):
    """((q, k, v) of the image tokens, (q, k, v) of the joint text tokens or None), by the module's kind:
    text before the image (joint_first) or after it (joint_last)."""
    if kind not in ("joint_first", "joint_last") or text == 0:
        return (query, key, value), None
    if kind == "joint_first":
        return tuple(t[:, :, text:] for t in (query, key, value)), tuple(t[:, :, :text] for t in (query, key, value))
    return tuple(t[:, :, :-text] for t in (query, key, value)), tuple(t[:, :, -text:] for t in (query, key, value))


def join_text(kind: str, out, joint_out):
    """The attention output in the module's own token order (split_text undone)."""
    if joint_out is None:
        return out
    return torch.cat([joint_out, out] if kind == "joint_first" else [out, joint_out], dim=2)


@torch.library.custom_op("xdit_lab::attend", mutates_args=())
def _attend_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: int,
    kind: str,
    name: str,
    scale: float | None,
    text_len: int,
    image_len: int | None,
    text_mask: torch.Tensor | None,
) -> torch.Tensor:
    strategy = comm.from_handle(state).strategy
    return strategy.attend(kind, name, query, key, value, scale, text_len, image_len, text_mask).contiguous()


@_attend_op.register_fake
def _(query, key, value, state, kind, name, scale, text_len, image_len, text_mask):
    return query.new_empty(query.shape)  # attention returns the queries' shape, contiguous


# ---- batch: split over cfg and dp on the way in, gather on the way out ----------------------------------


def split_batch(state: ParallelState, arguments: dict) -> list[int]:
    """Keep this rank's rows of every batched forward argument (in place); returns the dp shard sizes.

    cfg 2 takes its half of [uncond; cond]; dp then splits what is left by rows (uneven splits as
    torch.tensor_split makes them). A dp group without rows computes a stand-in (the branch's last
    row) so that every collective still lines up; gather_batch drops it."""
    mesh, config = state.mesh, state.mesh.config
    hidden = arguments.get("hidden_states")
    if hidden is None:
        raise ValueError("the forward needs hidden_states")
    total = hidden.shape[0]
    dp_rank = mesh.group_rank(DP)
    start, stop, dp_sizes = batch_rows(total, config.cfg, config.dp, mesh.group_rank(CFG), dp_rank)
    state.stand_in = dp_sizes[dp_rank] == 0
    local = slice(start, stop)
    if (local.start, local.stop) != (0, total):
        for name, value in list(arguments.items()):
            if name not in state.adapter.unbatched and name not in state.adapter.not_batched_dicts:
                arguments[name] = _take_batch(value, total, local)
    return dp_sizes


def _take_batch(value, total, local):
    if isinstance(value, torch.Tensor):
        return value[local] if value.dim() >= 1 and value.shape[0] == total else value
    if isinstance(value, dict):
        return {k: _take_batch(v, total, local) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return type(value)(_take_batch(v, total, local) for v in value)
    return value


def gather_batch(state: ParallelState, output, dp_sizes: list[int]):
    """Every rank's rows of the forward's output, gathered over dp (dropping stand-ins), then cfg.
    None (a PipeFusion stage before the last, under the async schedule) stays None."""
    mesh = state.mesh
    if output is None:
        return None
    sample = output[0] if isinstance(output, tuple) else output.sample
    sample = comm.all_gather(sample.contiguous(), mesh, DP, dim=0, sizes=dp_sizes, tag="sample")
    sample = comm.all_gather(sample, mesh, CFG, dim=0, tag="sample")
    if isinstance(output, tuple):
        return (sample, *output[1:])
    output.sample = sample
    return output
