"""The hook machinery every strategy shares: diffusers' model runs unchanged, and xdit_lab takes
over at the places the family adapter (xdit_lab/families/) names:

  1. the forward's inputs: the batch [uncond; cond] is split over the cfg group, then over dp (a list with
     one tensor per sample, Z-Image's latents and captions, by its samples)
  2. the patch embedding's output: the strategy keeps this rank's tokens         strategy.shard
     (or the input of the first module that takes them whole: Z-Image's image refiner)
  3. rotary tables (Flux): the strategy keeps the rows of its tokens             strategy.shard_rotary
  4. the joint text, where the adapter says it enters the blocks: the strategy keeps this rank's
     text tokens too (sequence shards do; a PipeFusion stage keeps the text whole)  strategy.shard_text
     (Z-Image's first main layer takes [image; text] joined: the text's part is cut there); where the
     forward builds its text itself, its length is read from the module that makes it
  5. the attention of every known self or joint attention module: the strategy attends, told the
     module's kind (self, joint_first, joint_last)                             strategy.attend
     linear attention (Sana) runs our processor, whose sums over the tokens are the strategy's
     (linear_attention.py)                                                     strategy.linear_sums
  5b. a convolution over token rows (Sana's feed-forward): each block told this rank's rows, the
     module's input widened by its neighbours' rows (row_halo.py)    strategy.token_rows, halo
     (an attention module the adapter does not know is refused at parallelize time; cross and text
     attention see whole text K/V on every rank and run as diffusers wrote them)
  6. arguments with one entry per image token (adapter.per_token: Wan 2.2's timestep per token,
     Qwen-Image-Edit's modulate_index, HunyuanVideo I2V's frame-0 count), at the forward or as each
     block takes them: the strategy keeps its tokens' entries    strategy.keep_tokens, keep_prefix
  7. the last projection's output, before unpatchify: tokens come back whole    strategy.gather
     and the forward's output is gathered over dp and cfg, so every rank returns the full batch

How attention is taken over, without watching every torch call:
  - processors that call diffusers' dispatcher (`dispatch_attention_fn`: Flux, Flux.2, Qwen-Image,
    Wan, HunyuanVideo) are pointed at a backend registered in it, "xdit_lab", and handed the module's
    AttentionSite as their `_parallel_config` (the dispatcher passes it on to the backend)
  - processors that call F.scaled_dot_product_attention themselves (PixArt, SD3, CogVideoX, DiT) run
    as a copy whose `F` names a functional module with that one function bound to the site: the same
    code object, its own globals (`rebind_sdpa`); nothing of diffusers' processor is rewritten
  - a user's diffusers attention backend (`set_attention_backend("flex")`, DIFFUSERS_ATTN_BACKEND)
    is replaced on the modules the strategy attends (a warning names it); after parallelize, diffusers
    itself refuses one (the processors carry a parallel config), and every forward first checks that
    each attended module still runs its site (a module that did not would attend to its own shard)
  - under torch.compile (parallelize(..., compile=True)) the strategy's attention and each gather are
    one opaque operator each (xdit_lab::attend, xdit_lab::all_gather): the graph stays whole, and the
    collectives inside run and are recorded as in eager
  - a strategy with nothing to split (sequence shards on a group of one: cfg and dp only) gets no hook
    at all: diffusers' forward runs as it is, on this rank's batch rows

How tokens are split is the strategy's alone: one contiguous shard per sequence-parallel rank
(sequence.py), or a PipeFusion stage's patches (pipefusion/). The hooks below never ask which; a
strategy says what it needs (`splits_tokens`, `takes_attention`, `text_shard_at`: the members of
TokenStrategy, models/strategy.py, that decide what is installed).
`parallel_state(module)` is the one way to read what a parallelized module knows.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import types
import weakref

import torch
import torch.nn.functional as F

from .. import comm
from ..families import block_metadata
from ..families.adapter import STRATEGY_KINDS, RankLocal
from ..mesh import CFG, DP
from ..sharding import batch_rows
from .installed import Installed
from .linear_attention import install_linear_attention
from .row_halo import install_row_convolution
from .strategy import Controls, TokenStrategy

log = logging.getLogger("xdit_lab.models")

BACKEND_NAME = "xdit_lab"  # the attention backend registered in diffusers' dispatcher


class ParallelState:
    """What one parallelized module knows: its adapter, the mesh, the controls it was given, the token
    strategy, and what the forward running now has seen (the text length, the whole image length)."""

    def __init__(self, adapter, mesh, controls: Controls):
        self.adapter, self.mesh = adapter, mesh
        self.controls = controls  # this model's deliberately wrong variants (none by default), which its strategy reads
        self.handle = comm.handle(self)  # how a compiled graph's operators find this state
        self.strategy: TokenStrategy | None = None  # SequenceShards or PipeFusionStage, set by parallelize
        self.cache = None  # a FirstBlockCache when parallelize was given a StepCache
        self.weights = None  # a ShardedWeights when parallelize was asked to shard them (sharded_weights.py)
        self.stand_in = False  # this rank computes a dp stand-in row (it has no rows of its own)
        self.in_forward = False
        self.text_len = 0  # joint text tokens of the running forward (the whole text, however it is split)
        self.image_len = None  # whole image tokens, set where they are sharded
        self.text_mask = None  # the joint text's whole key mask [B, T] bool, where the blocks take it (adapter)
        self.whole_query_len = 0  # queries whole on every rank in "whole_queries" attention (LTX-2's audio tokens)
        self.also_gathered = 0  # elements a sample of the outputs gathered beside the sample (LTX-2's audio)
        self.sites: list[tuple[weakref.ref, AttentionSite]] = []  # the attended modules (held weakly)
        self.hooks = Installed()  # every hook and replacement parallelize installed, by name (unparallelize)
        self.owns_mesh = False  # parallelize made the mesh: unparallelize closes it

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
    """Shard, rotary, text and gather hooks at the adapter's places, and the attention of every known
    self and joint attention module handed to the strategy (as far as the strategy needs them)."""
    adapter, strategy = state.adapter, state.strategy
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
        if kind == "linear" and strategy.takes_attention:  # no SDPA: our processor (linear_attention.py)
            install_linear_attention(module, name, state)
        elif kind in STRATEGY_KINDS and strategy.takes_attention:
            before = _attend_through_site(module, AttentionSite(state, kind, name), state.hooks)
            if before is not None:
                replaced.setdefault(before, []).append(name)
    if not known:
        raise TypeError(
            f"no attention modules of {type(transformer).__name__} matched the {adapter.family} adapter; "
            f"this diffusers release may have renamed them"
        )
    for backend, names in replaced.items():
        log.warning(
            "%d attention modules of %s were set to diffusers' %r attention backend, which the parallel "
            "kernels cannot take over; they run diffusers' registered backend %r now, xdit_lab's kernels (see "
            "xdit_lab.attention.attention_backend)",
            len(names),
            type(transformer).__name__,
            backend,
            BACKEND_NAME,
        )
    if strategy.splits_tokens:
        if adapter.shard_at_input:  # Z-Image: the image refiner's first block takes the whole image tokens
            _hook_first_input(transformer, state, adapter.shard_at, "shard")  # (a PipeFusion stage may hold none)
        else:
            _hook_output(transformer, state, adapter.shard_at, "shard")
        for path in adapter.shard_also:
            _hook_output(transformer, state, path, "shard")
        if adapter.gather_at is not None:  # None: a ControlNet, whose residuals stay this rank's
            _hook_output(transformer, state, adapter.gather_at, "gather")
        for path in (adapter.rotary_at, *adapter.rotary_also) if adapter.rotary_at else ():
            _hook_output(transformer, state, path, "shard_rotary")
        for entry in adapter.per_token:
            if entry.module:
                _hook_per_token(transformer, state, entry)
        if adapter.row_convolution is not None:  # a convolution over token rows: halo rows (row_halo.py)
            install_row_convolution(transformer, state)
    if strategy.text_shard_at == "block":
        _hook_text_at_first_block(transformer, state)
    elif strategy.text_shard_at == "joined":
        _hook_joined_text_at_first_block(transformer, state)
    if adapter.text_len_at is not None:
        _hook_text_len(transformer, state, adapter.text_len_at)
    if adapter.text_mask_argument is not None and strategy.takes_attention:
        _hook_text_mask(transformer, state)
    setattr(transformer, STATE_ATTRIBUTE, state)


def local_mixing_layers(adapter, model) -> dict[str, int]:
    """What mixes tokens outside SDPA in `model` (the modules this rank holds), as the traffic's closed form
    counts it: linear-attention layers (their sums all-reduced), convolutions over token rows (their halo
    exchanged) and the rows of a halo."""
    names = [name for name, _ in model.named_modules()]
    rows = adapter.row_convolution
    return dict(
        linear_layers=sum(1 for name in names if adapter.attention_kind(name) == "linear"),
        row_conv_layers=0 if rows is None else sum(1 for name in names if re.search(rows.module, name)),
        halo_rows=0 if rows is None else rows.reach,
    )


def other_traffic_sizes(adapter, model) -> dict:
    """What the traffic's closed form counts beside the image's tokens, for the last forward of `model` (the
    modules this rank holds): the float32 elements per batch row that its "whole_queries" layers gather (each
    layer's heads × (head_dim + 1) × the whole queries), and the elements per sample of the outputs gathered over
    dp and cfg beside the sample (LTX-2's audio)."""
    state = parallel_state(model)
    layers = [m for name, m in model.named_modules() if adapter.attention_kind(name) == "whole_queries"]
    return dict(
        whole_query_rows=sum(m.heads * (m.head_dim + 1) for m in layers) * state.whole_query_len,
        also_gathered=state.also_gathered,
    )


def _hook_output(root, state, path: str, method: str):
    """The strategy's `method` on the output of module `path`, installed as "<method>[<path>]"."""
    fn = functools.partial(_when_running, state, method)
    state.hooks.forward_hook(f"{method}[{path}]", root.get_submodule(path), lambda _module, _inputs, output: fn(output))


def _hook_first_input(root, state, path: str, method: str):
    """The strategy's `method` on the first argument of module `path` (its hidden states), installed as
    "<method>[<path>]", before any other hook of that module (a PipeFusion stage's first block then takes the
    previous stage's tokens in place of what this one cut). A block a PipeFusion stage does not hold gets none:
    that stage takes its tokens from the stage before."""
    try:
        module = root.get_submodule(path)
    except AttributeError:
        if state.mesh.config.pipefusion == 1:
            raise
        return

    def hook(_module, args, kwargs):
        if not state.in_forward:
            return None
        if args:
            return (getattr(state.strategy, method)(args[0]), *args[1:]), kwargs
        name = next(iter(kwargs))  # the hidden states passed by name: the block's first argument
        return args, {**kwargs, name: getattr(state.strategy, method)(kwargs[name])}

    state.hooks.forward_pre_hook(f"{method}[{path}]", module, hook, with_kwargs=True, prepend=True)


def _hook_text_len(root, state, pattern: str):
    """The joint text's length, from the output [B, T, C] of the modules `pattern` matches (Z-Image's caption
    refiner blocks): the text the blocks take is built inside the forward, after its input."""

    def note(_module, _inputs, output):
        if state.in_forward:
            state.text_len = output.shape[1]

    for name, module in root.named_modules():
        if name and re.search(pattern, name):
            state.hooks.forward_hook(f"text_len[{name}]", module, note)


def _when_running(state, method: str, value):
    """A hooked module also runs outside a parallel forward (e.g. a probe): leave it alone then."""
    return getattr(state.strategy, method)(value) if state.in_forward else value


def _hook_text_at_first_block(transformer, state) -> None:
    """The joint text as the model's first block takes it (HunyuanVideo, CogVideoX, Qwen-Image): the
    strategy keeps its share there, once per forward; the blocks after take it from the one before."""
    blocks = state.adapter.blocks(transformer)
    if not blocks:
        return
    first = blocks[0]
    name = block_metadata(first).encoder_hidden_states_argument_name
    position = list(inspect.signature(type(first).forward).parameters).index(name) - 1  # without self

    def shard_text(_module, args, kwargs):
        if not state.in_forward:
            return None
        if name in kwargs:
            if kwargs[name] is not None:
                kwargs[name] = state.strategy.shard_text(kwargs[name])
        elif len(args) > position and args[position] is not None:
            args = (*args[:position], state.strategy.shard_text(args[position]), *args[position + 1 :])
        return args, kwargs

    state.hooks.forward_pre_hook("shard_text", first, shard_text, with_kwargs=True, prepend=True)


def _hook_joined_text_at_first_block(transformer, state) -> None:
    """The joint text where the first block of the adapter's joined lists takes it joined after the image, [image;
    text] as its first argument (Z-Image's forward joins them between its refiners and its layers): the strategy
    keeps its share of the text there, beside its image tokens; the blocks after take it from the one before."""
    blocks = [block for name in state.adapter.joined_block_lists[:1] for block in getattr(transformer, name)]
    if not blocks:
        return

    def shard_text(_module, args, kwargs):
        if not state.in_forward:
            return None
        joined, image = args[0], args[0].shape[1] - state.text_len
        text = state.strategy.shard_text(joined[:, image:])
        return (torch.cat([joined[:, :image], text], dim=1), *args[1:]), kwargs

    state.hooks.forward_pre_hook("shard_text", blocks[0], shard_text, with_kwargs=True, prepend=True)


def _hook_text_mask(transformer, state) -> None:
    """Every block's joint-text padding mask [B, T] (adapter.text_mask_argument), from which its attention builds
    the mask over the tokens it holds: the block takes this rank's share of it, cut as the text (whole where the
    strategy keeps the text whole), and the parallel kernels read the whole one (state.text_mask). Installed
    before the text's own cut at the first block."""
    name = state.adapter.text_mask_argument
    for index, block in enumerate(state.adapter.blocks(transformer)):
        position = list(inspect.signature(type(block).forward).parameters).index(name) - 1  # without self

        def cut(_module, args, kwargs, position=position):
            if not state.in_forward:
                return None
            given = name in kwargs
            mask = kwargs[name] if given else args[position]
            state.text_mask = mask.bool()
            mine = state.strategy.shard_text(mask)
            if given:
                return args, {**kwargs, name: mine}
            return (*args[:position], mine, *args[position + 1 :]), kwargs

        state.hooks.forward_pre_hook(f"text_mask[{index}]", block, cut, with_kwargs=True, prepend=True)


def _hook_per_token(transformer, state, entry) -> None:
    """Each module `entry.module` matches keeps this rank's entries of its per-token argument (the
    forward builds it whole and hands the same one to every block: each block's copy is cut). A matching
    module without the argument is another variant's (HunyuanVideo's blocks without token replace)."""
    for name, module in transformer.named_modules():
        if not re.search(entry.module, name):
            continue
        parameters = list(inspect.signature(type(module).forward).parameters)
        if entry.argument not in parameters:
            continue
        position = parameters.index(entry.argument) - 1  # without self

        def keep(_module, args, kwargs, position=position):
            if not state.in_forward:
                return None
            if entry.argument in kwargs:
                kwargs[entry.argument] = entry.keep(state.strategy, kwargs[entry.argument])
            elif len(args) > position:
                args = (*args[:position], entry.keep(state.strategy, args[position]), *args[position + 1 :])
            return args, kwargs

        state.hooks.forward_pre_hook(f"per_token[{name}].{entry.argument}", module, keep, with_kwargs=True)


def keep_forward_per_token(state, arguments: dict, whole: dict | None = None) -> None:
    """The forward's own per-token arguments (adapter.per_token, module ""): this rank's entries, in place.
    `whole` holds them as the caller gave them, for a strategy that cuts them again per patch."""
    for entry in state.adapter.per_token:
        if not entry.module and entry.argument in arguments:
            value = whole[entry.argument] if whole is not None else arguments[entry.argument]
            arguments[entry.argument] = entry.keep(state.strategy, value)


def run_forward(state: ParallelState, forward, bound):
    """The model's own forward, with the hooks active (they leave a module alone outside it), once
    every attended module is seen to run its site."""
    check_sites(state)
    state.in_forward = True
    try:
        return forward(*bound.args, **bound.kwargs)
    finally:
        state.in_forward = False


# ---- attention: the strategy attends for every known self and joint attention module ------------------


class AttentionSite:
    """One attention module whose attention the strategy computes: its kind and name, and the
    processor that calls into it. It is what diffusers' dispatcher hands the "xdit_lab" backend (the
    processor's `_parallel_config`), and what a rebound F.scaled_dot_product_attention calls."""

    context_parallel_config = None  # read by nothing of ours; diffusers' backends would look here

    def __init__(self, state: ParallelState, kind: str, name: str):
        self.state, self.kind, self.name = state, kind, name
        self.processor = None  # the processor this site was installed on (checked every forward)
        self.through_dispatch = False

    def attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """q, k, v [B, H, S, D] (SDPA layout, any strides) -> the output [B, S, H, D], contiguous."""
        state = self.state
        if not state.in_forward:  # e.g. a probe outside the parallel forward: plain attention
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
            )
            return out.transpose(1, 2).contiguous()
        if is_causal or dropout_p or enable_gqa:
            raise NotImplementedError(
                f"{self.name}: {self.kind} attention that is causal, has dropout or grouped K/V heads is not "
                f"sequence-parallel"
            )
        text_mask = None if attn_mask is None else self._text_key_mask(attn_mask, query)
        # The lengths travel as arguments: under compile, what the forward wrote on the state so far
        # reaches it only after the graph, while the operator runs inside it.
        lengths = state.text_len, state.image_len
        if torch.compiler.is_compiling():
            return torch.ops.xdit_lab.attend(
                query, key, value, state.handle, self.kind, self.name, scale, *lengths, text_mask
            )
        out = state.strategy.attend(self.kind, self.name, query, key, value, scale, *lengths, text_mask)
        return out.transpose(1, 2).contiguous()  # free where the strategy wrote [B, S, H, D] memory

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """F.scaled_dot_product_attention as a rebound processor calls it: [B, H, S, D] in and out."""
        return self.attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa).transpose(1, 2)

    def _text_key_mask(self, mask, query):
        """[B, T] bool over the whole joint text's keys, from the mask a family with padded text builds
        (Qwen-Image: [B, 1, 1, T + S_me], text first; HunyuanVideo: [B, 1, 1, S_me + T], text last; the
        image columns true by construction, the text's columns its whole text whether or not the
        strategy shards it). Any other mask would mask image keys this rank does not hold: refused."""
        text, adapter = self.state.text_len, self.state.adapter
        keys = query.shape[2]  # this rank's text (shard or whole) and image tokens
        if adapter.text_mask_argument is not None and tuple(mask.shape) == (query.shape[0], 1, keys, keys):
            # built by the processor from this rank's share of the blocks' text mask: the whole one is the state's
            return self.state.text_mask
        if not (
            adapter.text_key_mask
            and self.kind in ("joint_first", "joint_last")
            and text
            and mask.dtype == torch.bool
            and mask.dim() == 4
            and tuple(mask.shape[:3]) == (query.shape[0], 1, 1)
            and 0 < mask.shape[3] - text <= keys
        ):
            raise NotImplementedError(
                f"{self.name} ({self.kind} attention of {adapter.family}) passes an attention mask "
                f"({str(mask.dtype).replace('torch.', '')} {tuple(mask.shape)}); the parallel kernels take only a "
                f"padded-text key mask, [batch, 1, 1, text + image] bool, from families that declare one "
                f"(FamilyAdapter.text_key_mask)"
            )
        return mask[:, 0, 0, :text] if self.kind == "joint_first" else mask[:, 0, 0, mask.shape[3] - text :]


def _attend_through_site(module, site: AttentionSite, hooks: Installed) -> str | None:
    """Make `module`'s attention the site's: through diffusers' dispatcher where its processor calls
    it, else through a copy of its processor with F.scaled_dot_product_attention rebound (installed in
    `hooks` as "attention[<module>]"). Returns the
    diffusers attention backend the module was set to before, if it was another than the native one."""
    processor = module.processor
    call = type(processor).__call__
    names = call.__code__.co_names
    if hasattr(processor, "_attention_backend") and "dispatch_attention_fn" in names:
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        backend = registered_backend()
        chosen = processor._attention_backend or _AttentionBackendRegistry._active_backend
        chosen = AttentionBackendName(chosen).value
        hooks.replace(f"attention[{site.name}]", processor, _attention_backend=backend, _parallel_config=site)
        site.processor, site.through_dispatch = processor, True
        site.state.sites.append((weakref.ref(module), site))
        return None if chosen in (AttentionBackendName.NATIVE.value, BACKEND_NAME) else chosen
    if "F" in names and "scaled_dot_product_attention" in names:
        site.processor = rebind_sdpa(processor, site.sdpa)
        hooks.replace(f"attention[{site.name}]", module, processor=site.processor)
        site.state.sites.append((weakref.ref(module), site))
        return None
    raise TypeError(
        f"attention module {site.name} runs {type(processor).__name__}, which calls neither diffusers' "
        f"dispatch_attention_fn nor F.scaled_dot_product_attention: xdit_lab cannot take its attention over"
    )


def rebind_sdpa(processor, sdpa):
    """A copy of diffusers' `processor` whose own code (the same code object) finds `F` to be a
    functional module where scaled_dot_product_attention is `sdpa`: a subclass whose __call__ is the
    processor's __call__ with its own globals. Signature, defaults and behaviour otherwise unchanged (so
    diffusers' Attention still reads which keyword arguments it takes), traceable by torch.compile."""
    cls = type(processor)
    call = cls.__call__
    functional = types.ModuleType(F.__name__, F.__doc__)
    functional.__dict__.update(vars(F))
    functional.scaled_dot_product_attention = sdpa
    # its own globals, without a __name__: torch.compile then reads them as this dict (by id), not as the
    # module of that name, where F is torch's
    scope = {name: value for name, value in call.__globals__.items() if name != "__name__"}
    scope["F"] = functional
    rebound = types.FunctionType(call.__code__, scope, call.__name__, call.__defaults__, call.__closure__)
    rebound.__kwdefaults__, rebound.__qualname__ = call.__kwdefaults__, call.__qualname__
    subclass = type(cls.__name__, (cls,), {"__call__": rebound, "__module__": cls.__module__, "__doc__": cls.__doc__})
    copy = subclass.__new__(subclass)
    copy.__dict__.update(vars(processor))
    return copy


def check_sites(state: ParallelState) -> None:
    """Every attended module still runs its site: a processor replaced or pointed at another diffusers
    attention backend after parallelize would attend to this rank's own shard only."""
    for module_ref, site in state.sites:
        module = module_ref()
        if module is None:
            continue
        processor = module.processor
        if processor is site.processor and (
            not site.through_dispatch
            or (processor._attention_backend is _BACKEND and processor._parallel_config is site)
        ):
            continue
        found = getattr(processor, "_attention_backend", None)
        raise RuntimeError(
            f"attention module {site.name} ({site.kind}) no longer runs xdit_lab's kernels (its processor is "
            f"{type(processor).__name__}{f', attention backend {found!r}' if found is not None else ''}), so its "
            f"attention would cover this rank's own shard only; parallelize a fresh model, or leave its attention "
            f"as parallelize set it"
        )


_BACKEND = None  # the registered member of diffusers' AttentionBackendName


def registered_backend():
    """The "xdit_lab" member of diffusers' AttentionBackendName, registered in its dispatcher (once per
    process) with `dispatched_attention` as its function."""
    global _BACKEND
    if _BACKEND is not None:
        return _BACKEND
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    member = AttentionBackendName._value2member_map_.get(BACKEND_NAME)
    if member is None:  # an Enum takes no members after its class is made: add one as the class would have
        member = str.__new__(AttentionBackendName, BACKEND_NAME)
        member._name_, member._value_ = BACKEND_NAME.upper(), BACKEND_NAME
        member.__objclass__ = AttentionBackendName
        member._sort_order_ = len(AttentionBackendName._member_names_)
        AttentionBackendName._member_map_[member._name_] = member
        AttentionBackendName._value2member_map_[BACKEND_NAME] = member
        AttentionBackendName._member_names_.append(member._name_)
        type.__setattr__(AttentionBackendName, member._name_, member)
    _AttentionBackendRegistry.register(member)(dispatched_attention)
    _BACKEND = member
    return member


def dispatched_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    _parallel_config=None,
):
    """The "xdit_lab" backend of diffusers' dispatcher: q, k, v [B, S, H, D] (the dispatcher's layout),
    handed to the strategy through the site the processor carries."""
    site = _parallel_config
    if not isinstance(site, AttentionSite):
        raise RuntimeError(
            f"the {BACKEND_NAME!r} attention backend runs only inside a model that xdit_lab.parallelize set up "
            f"(a processor carrying its AttentionSite); this call came with {type(site).__name__}"
        )
    return site.attend(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
    )


# forward arguments that address blocks by index (SD3's skip-layer guidance, ControlNet residuals)
PER_BLOCK_ARGUMENTS = (
    "skip_layers",
    "block_controlnet_hidden_states",
    "controlnet_block_samples",
    "controlnet_single_block_samples",
)


def refuse_per_block(arguments: dict, adapter) -> None:
    """Forward arguments a PipeFusion stage cannot take: the forward indexes them by its loop index,
    which a stage counts from its own first block (but the residual lists the adapter declares, which the stage
    rebases: adapter.block_residuals)."""
    rebased = {entry.argument for entry in adapter.block_residuals}
    per_block = [name for name in PER_BLOCK_ARGUMENTS if arguments.get(name) is not None and name not in rebased]
    if per_block:
        raise NotImplementedError(
            f"{', '.join(per_block)} name blocks by their index in the whole model, which a PipeFusion stage "
            f"does not hold; run them without PipeFusion"
        )


def refuse_unsplittable(arguments: dict) -> None:
    """Forward arguments whose tokens no strategy can split yet (ulysses, ring and pipefusion must be 1):
    Flux.2's reference-image K/V cache."""
    if arguments.get("kv_cache_mode") is not None:
        raise NotImplementedError(
            "Flux.2's reference-image K/V cache (kv_cache_mode) is not sequence-parallel or pipelined yet; "
            "run it under cfg and dp only (ulysses = ring = pipefusion = 1)"
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
    out = strategy.attend(kind, name, query, key, value, scale, text_len, image_len, text_mask)
    return out.transpose(1, 2).contiguous()


@_attend_op.register_fake
def _(query, key, value, state, kind, name, scale, text_len, image_len, text_mask):
    batch, heads, tokens, head_dim = query.shape
    return query.new_empty((batch, tokens, heads, head_dim))  # [B, S, H, D], contiguous


# ---- batch: split over cfg and dp on the way in, gather on the way out ----------------------------------


def split_batch(state: ParallelState, arguments: dict) -> list[int]:
    """Keep this rank's rows of every batched forward argument (in place); returns the dp shard sizes.

    cfg 2 takes its half of [uncond; cond]; dp then splits what is left by rows (uneven splits as
    torch.tensor_split makes them). A dp group without rows computes a stand-in (the branch's last
    row) so that every collective still lines up; gather_batch drops it. It also notes the forward's
    whole text length (state.text_len), before any strategy keeps its share of the text."""
    mesh, config = state.mesh, state.mesh.config
    hidden = arguments.get(state.adapter.latents_argument)
    if hidden is None:
        raise ValueError(f"the forward needs {state.adapter.latents_argument}")
    text = arguments.get("encoder_hidden_states")
    state.text_len = text.shape[1] if isinstance(text, torch.Tensor) and text.dim() >= 2 else 0
    if state.adapter.joint_text_len is not None:  # the forward joins the text the blocks take
        state.text_len = state.adapter.joint_text_len(arguments)
    if state.adapter.whole_query_len is not None:
        state.whole_query_len = state.adapter.whole_query_len(arguments)
    total = len(hidden) if isinstance(hidden, list) else hidden.shape[0]  # a list: one tensor per sample (Z-Image)
    dp_rank = mesh.group_rank(DP)
    start, stop, dp_sizes = batch_rows(total, config.cfg, config.dp, mesh.group_rank(CFG), dp_rank)
    state.stand_in = dp_sizes[dp_rank] == 0
    local = slice(start, stop)
    if (local.start, local.stop) != (0, total):
        for name, value in list(arguments.items()):
            if name in state.adapter.per_sample_lists and isinstance(value, list) and len(value) == total:
                arguments[name] = value[local]
            elif name not in state.adapter.unbatched and name not in state.adapter.not_batched_dicts:
                arguments[name] = _take_batch(value, total, local)
    return dp_sizes


def _take_batch(value, total, local):
    if isinstance(value, RankLocal):  # this rank's rows already (a ControlNet's residuals)
        return value
    if isinstance(value, torch.Tensor):
        return value[local] if value.dim() >= 1 and value.shape[0] == total else value
    if isinstance(value, dict):
        return {k: _take_batch(v, total, local) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return type(value)(_take_batch(v, total, local) for v in value)
    return value


def gather_batch(state: ParallelState, output, dp_sizes: list[int]):
    """Every rank's rows of the forward's output, gathered over dp (dropping stand-ins), then cfg; a tuple's
    other tensors too (LTX-2's audio prediction beside the video's). None (a PipeFusion stage before the last,
    under the async schedule) stays None."""
    mesh = state.mesh
    if output is None:
        return None

    def gathered(sample):
        per_sample = isinstance(sample, list)  # one tensor per sample (Z-Image): gathered as their stack
        sample = torch.stack(sample) if per_sample else sample
        sample = comm.all_gather(sample.contiguous(), mesh, DP, dim=0, sizes=dp_sizes, tag="sample")
        sample = comm.all_gather(sample, mesh, CFG, dim=0, tag="sample")
        return list(sample.unbind(0)) if per_sample else sample

    if isinstance(output, tuple):
        state.also_gathered = sum(t[0].numel() for t in output[1:] if isinstance(t, torch.Tensor))
        rest = [gathered(t) if isinstance(t, torch.Tensor) else t for t in output[1:]]
        return (gathered(output[0]), *rest)
    output.sample = gathered(output.sample)
    return output
