"""parallelize: run a diffusers DiT under data, CFG and sequence parallelism, unchanged.

The model's own forward runs; xdit_lab takes over at five places, named by the family adapter:
  1. the forward's inputs: the batch [uncond; cond] is split over the cfg group, then over dp
  2. the patch embedding's output: image tokens are cut into this rank's sequence shard
  3. rotary tables (Flux, CogVideoX): sliced to this rank's tokens, text rows kept
  4. every F.scaled_dot_product_attention call inside a known attention module: handed to
     sp_attention, with the text tokens (if any) split off as joint tokens. diffusers can route
     a module's attention to other kernels (`set_attention_backend("flex")`, the
     DIFFUSERS_ATTN_BACKEND variable), which never call F.scaled_dot_product_attention: the
     known modules are set back to diffusers' native backend here, and a known module that
     returns without its attention reaching us raises (it would have attended to its shard only)
  5. the last projection's output (before unpatchify): tokens gathered over the sp group; the
     forward's output is gathered over dp and cfg, so every rank returns the full batch
Weights are not copied; the module is returned with the same forward signature.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import comm
from ..attention import sp_attention
from ..config import ParallelConfig, ParallelConfigError
from ..mesh import RankMesh
from ..sharding import shard_range, shard_sizes
from .families import adapter_for, check_diffusers_version, image_tokens_at_default_size


log = logging.getLogger("xdit_lab.models")


class ParallelState:
    """What one parallel forward knows: the mesh, the shard of this rank, the text length."""

    def __init__(self, adapter, mesh: RankMesh):
        self.adapter, self.mesh = adapter, mesh
        self.in_forward = False
        self.text_len = 0
        self.image_len = None  # whole image tokens, set where they are sharded
        self.attention_kind = None  # kind of the attention module running now
        self.attention_name = None  # and its qualified name
        self.attention_reached = False  # whether its attention came through the interceptor
        self.shard = None  # (start, stop) of this rank's image tokens, for views
        self.pipefusion = None  # a PipeFusion stage (models/pipelined.py) takes over tokens and attention

    def take_image_shard(self, tokens: torch.Tensor, dim: int = 1) -> torch.Tensor:
        sp = self.mesh.group_size("sp")
        total = tokens.shape[dim]
        if total < sp:
            raise ValueError(f"{total} image tokens cannot be split over {sp} sequence-parallel ranks "
                             f"(ulysses {self.mesh.group_size('ulysses')} × ring {self.mesh.group_size('ring')}); "
                             f"use a larger image or a smaller degree")
        self.image_len = total
        self.shard = shard_range(total, sp, self.mesh.group_rank("sp"))
        return tokens.narrow(dim, self.shard[0], self.shard[1] - self.shard[0])


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: RankMesh | None = None, *,
                stage_split: list[int] | None = None):
    """Make `transformer` (a diffusers DiT) run under `config` on this rank; returns it.

    Call it on every rank after init_distributed. Every rank returns the same full output.
    `stage_split` overrides PipeFusion's balanced split: blocks per stage, e.g. [10, 9, 9]."""
    check_diffusers_version()
    adapter = adapter_for(transformer)
    if getattr(transformer, "_xdit_lab_state", None) is not None:
        raise ValueError(f"this {type(transformer).__name__} is already parallelized; build or load a fresh one")
    heads = transformer.config.get("num_attention_heads")
    config.validate(num_heads=heads, num_layers=transformer.config.get("num_layers"),
                    seq_len=image_tokens_at_default_size(transformer))
    mesh = mesh or RankMesh(config)
    if mesh.config != config:
        raise ValueError(f"mesh was built for {mesh.config.short()}, not {config.short()}")
    if not mesh.active:
        raise ValueError(f"rank {mesh.rank} is idle in {config.short()} ({config.world_size} of {mesh.world_size} "
                         f"ranks): only ranks with mesh.active run the model")

    state = ParallelState(adapter, mesh)
    if config.pipefusion > 1:
        from .pipelined import apply_pipefusion

        return apply_pipefusion(transformer, config, mesh, state, stage_split)
    install_hooks(transformer, state)
    original_forward, signature = own_forward(transformer)

    @functools.wraps(original_forward)
    def parallel_forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        dp_sizes = _split_batch(state, bound.arguments)
        tables = bound.arguments.get(adapter.rotary_kwarg) if adapter.rotary_kwarg else None
        if tables is not None:  # rows are image tokens only: keep this rank's
            bound.arguments[adapter.rotary_kwarg] = tuple(state.take_image_shard(t, dim=0) for t in tables)
        text = bound.arguments.get("encoder_hidden_states")
        state.text_len = text.shape[1] if text is not None and text.dim() >= 2 else 0
        return _gather_batch(state, run_forward(state, original_forward, bound), dp_sizes)

    transformer.forward = parallel_forward
    return transformer


def own_forward(transformer):
    """The model's own forward and its signature, holding the model weakly.

    The parallel forward is stored on the model (`transformer.forward = ...`). Had its closure
    held the bound forward, the model would reference itself and outlive its last user until a
    garbage collection ran, keeping its weights (and GPU memory) through a reconfigure. So the
    closure holds a weak reference and binds the class's forward at call time. A forward that
    someone else already put on the instance is kept as it is."""
    if "forward" in vars(transformer):
        return transformer.forward, inspect.signature(transformer.forward)
    model, function = weakref.ref(transformer), type(transformer).forward

    @functools.wraps(function)
    def forward(*args, **kwargs):
        return function(model(), *args, **kwargs)

    signature = inspect.signature(transformer.forward)  # without self
    forward.__signature__ = signature
    return forward, signature


def run_forward(state, forward, bound):
    """The model's own forward, with the hooks active and attention handed to the kernels."""
    state.in_forward, state.attention_kind = True, None
    try:
        with _AttentionInterceptor(state):
            return forward(*bound.args, **bound.kwargs)
    finally:
        state.in_forward, state.attention_kind = False, None


def install_hooks(transformer, state) -> None:
    """Shard, rotary and gather hooks at the adapter's places; attention modules marked by kind."""
    adapter = state.adapter
    handles = [_hook_output(transformer, adapter.shard_at, functools.partial(_shard_tokens, state)),
               _hook_output(transformer, adapter.gather_at, functools.partial(_gather_tokens, state))]
    if adapter.rotary_at:
        handles.append(_hook_output(transformer, adapter.rotary_at, functools.partial(_shard_rotary, state)))
    known, replaced = 0, {}
    for name, module in transformer.named_modules():
        kind = adapter.attention_kind(name)
        if kind:
            known += 1
            backend = _use_native_attention(module)
            if backend is not None:
                replaced.setdefault(backend, []).append(name)
            handles.append(module.register_forward_pre_hook(functools.partial(_enter_attention, state, kind, name)))
            handles.append(module.register_forward_hook(functools.partial(_leave_attention, state)))
    if not known:
        raise TypeError(f"no attention modules of {type(transformer).__name__} matched the {adapter.family} adapter; "
                        f"this diffusers release may have renamed them")
    for backend, names in replaced.items():
        log.warning("%d attention modules of %s were set to diffusers' %r attention backend, which the parallel "
                    "kernels cannot take over; they run diffusers' native backend now, and xdit_lab's kernels do "
                    "the attention (see xdit_lab.attention.attention_backend)", len(names), type(transformer).__name__,
                    backend)
    transformer._xdit_lab_state = state
    transformer._xdit_lab_handles = handles


def _hook_output(root, path: str, fn):
    module = root.get_submodule(path)
    return module.register_forward_hook(lambda _module, _inputs, output: fn(output))


# ---- sequence: shard at the embedding, gather before unpatchify ------------------------------------

def _shard_tokens(state, tokens):
    if not state.in_forward:
        return tokens
    if state.pipefusion is not None:
        return state.pipefusion.shard(tokens)
    if state.adapter.text_before_image_at_shard:
        text, image = tokens[:, :state.text_len], tokens[:, state.text_len:]
        return torch.cat([text, state.take_image_shard(image)], dim=1)
    return state.take_image_shard(tokens)


def _shard_rotary(state, tables):
    if not state.in_forward:
        return tables
    text = state.text_len
    start, stop = state.shard

    def rows(t):
        return torch.cat([t[:text], t[text + start:text + stop]], dim=0)

    return tuple(rows(t) for t in tables) if isinstance(tables, tuple) else rows(tables)


def _gather_tokens(state, tokens):
    if not state.in_forward:
        return tokens
    if state.pipefusion is not None:
        return state.pipefusion.gather(tokens)
    sizes = shard_sizes(state.image_len, state.mesh.group_size("sp"))
    return comm.all_gather(tokens.contiguous(), state.mesh, "sp", dim=1, sizes=sizes, tag="tokens")


# ---- attention: hand SDPA calls of known modules to sp_attention -----------------------------------

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


def _enter_attention(state, kind, name, _module, _args):
    state.attention_kind, state.attention_name, state.attention_reached = kind, name, False


def _leave_attention(state, module, _args, _output):
    kind, state.attention_kind = state.attention_kind, None
    if state.in_forward and not state.attention_reached:
        processor = getattr(module, "processor", None)
        raise RuntimeError(
            f"attention module {state.attention_name} ({kind}) ran without calling F.scaled_dot_product_attention, "
            f"so its tokens were not handed to the sequence-parallel kernels and each rank would have attended to "
            f"its own shard only. Its processor is {type(processor).__name__}"
            f"{' with attention backend ' + repr(getattr(processor, '_attention_backend', None)) if processor else ''}; "
            f"keep diffusers' default processors and native attention backend on a parallelized model")


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _AttentionInterceptor(TorchFunctionMode):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        kind = self.state.attention_kind
        if kind is None:
            raise RuntimeError(f"attention outside the modules the {self.state.adapter.family} adapter knows: "
                               f"its tokens may be sharded, so it cannot run unchanged; extend the adapter")
        self.state.attention_reached = True
        if kind == "cross":  # image queries, whole text keys: exact as it is, on the local shard
            return func(*args, **kwargs)
        query, key, value, mask, dropout_p, is_causal, scale, _ = _sdpa_arguments(*args, **kwargs)
        if mask is not None or is_causal or dropout_p:
            raise NotImplementedError(f"{kind} attention with a mask, causal or dropout is not sequence-parallel yet")
        return _joint_or_self(self.state, kind, query, key, value, scale)


def _joint_or_self(state, kind, query, key, value, scale):
    mesh, text = state.mesh, state.text_len
    if state.pipefusion is not None:
        return state.pipefusion.attend(kind, query, key, value, scale)
    if kind == "self" or text == 0:
        return sp_attention(query, key, value, mesh, seq_len=state.image_len, scale=scale)
    if kind == "joint_first":
        split = [(t[:, :, text:], t[:, :, :text]) for t in (query, key, value)]
    else:  # joint_last
        split = [(t[:, :, :-text], t[:, :, -text:]) for t in (query, key, value)]
    (q, jq), (k, jk), (v, jv) = split
    out, joint_out = sp_attention(q, k, v, mesh, joint_q=jq, joint_k=jk, joint_v=jv, seq_len=state.image_len,
                                  scale=scale)
    return torch.cat([joint_out, out] if kind == "joint_first" else [out, joint_out], dim=2)


# ---- batch: split over cfg and dp on the way in, gather on the way out ------------------------------

def _split_batch(state, arguments: dict):
    mesh, config = state.mesh, state.mesh.config
    hidden = arguments.get("hidden_states")
    if hidden is None:
        raise ValueError("the forward needs hidden_states")
    total = hidden.shape[0]
    start, count = 0, total
    if config.cfg == 2:
        if total % 2:
            raise ValueError(f"cfg 2 splits the batch [unconditional; conditional] in halves, but the batch has "
                             f"{total} samples; pass both branches, or use cfg 1")
        count = total // 2
        start = mesh.group_rank("cfg") * count
    dp_sizes = shard_sizes(count, config.dp)
    mine = dp_sizes[mesh.group_rank("dp")]
    start += sum(dp_sizes[:mesh.group_rank("dp")])
    if mine == 0:
        # Fewer samples than dp groups: this group computes a stand-in (the branch's last sample)
        # so that every collective still lines up; the batch gather drops it (its size is 0).
        start, mine = start - 1, 1
    local = slice(start, start + mine)
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


def _gather_batch(state, output, dp_sizes):
    mesh = state.mesh
    sample = output[0] if isinstance(output, tuple) else output.sample
    sample = comm.all_gather(sample.contiguous(), mesh, "dp", dim=0, sizes=dp_sizes, tag="sample")
    sample = comm.all_gather(sample, mesh, "cfg", dim=0, tag="sample")
    if isinstance(output, tuple):
        return (sample, *output[1:])
    output.sample = sample
    return output
