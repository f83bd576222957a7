"""The weight planner: what one rank holds of each component's weights, from the safetensors headers alone
(the load's ModelFolder, parsed once), in every case a load places them:

    whole          every component on every rank, at the load dtype
    a stage        PipeFusion: the busiest stage's transformer blocks (and the expert's), plus everything
                   outside the blocks (embeddings, output layers), which every stage keeps
    an FSDP2 shard shard_weights: torch.chunk's largest piece of every parameter (buffers whole) over the
                   ranks that hold the same blocks; text encoders over the world; plus the gather buffer
    host-placed    a text encoder kept in host memory: nothing on the device
    offloaded      offload_blocks=N: the transformer in host memory, its blocks N at a time on the device (diffusers'
                   groups: N consecutive blocks of one list, any list among the model's children) and the rest of
                   its root with each call; the device holds that root and the largest group, and every weight
                   crosses to it once per call (Offloaded)
    quantized      a named scheme's linear weights (int8, float8): a byte per element and a scale per row

Only the components whose role moves are moved (model_folder.component_role): the transformer and the expert
are cut into stages, sharded or quantized, the text encoders sharded, host-placed or quantized; an image
encoder, a ControlNet and the VAE are whole on every rank, as diffusers loads them.

A safetensors file starts with an 8-byte little-endian header length and a JSON header giving every tensor's
dtype, shape and byte range, so sizes are known without reading weights (tensor_bytes, component_tensor_bytes:
the figures the lessons and the tests read a header by).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..families import FAMILIES, block_index
from ..model_folder import EXPERT, TRANSFORMER, ModelFolder, Weights
from ..safetensors_io import read_safetensors_header

DTYPE_BYTES = dict(F64=8, F32=4, F16=2, BF16=2, I64=8, I32=4, I16=2, I8=1, U8=1, BOOL=1, F8_E4M3=1, F8_E5M2=1)
FLOATS = {"F64", "F32", "F16", "BF16"}


def tensor_bytes(info: dict, dtype: torch.dtype | None) -> int:
    """Bytes of one header entry as loaded: floats cast to `dtype` (None: as stored)."""
    count = 1
    for dim in info["shape"]:
        count *= dim
    element = DTYPE_BYTES.get(info["dtype"], 4)
    if dtype is not None and info["dtype"] in FLOATS:  # floats are cast to the requested dtype on load
        element = torch.empty(0, dtype=dtype).element_size()
    return count * element


def component_tensor_bytes(folder: Path, dtype: torch.dtype | None, header=read_safetensors_header) -> dict[str, int]:
    """Bytes of every tensor in a component folder's safetensors, as loaded in `dtype`, from the headers alone
    (`header`: a file's table; ModelFolder.header parses each file once per load)."""
    return {
        key: tensor_bytes(info, dtype)
        for f in sorted(Path(folder).glob("*.safetensors"))
        for key, info in header(f).items()
    }


def block_bytes(tensors: dict[str, int], transformer_config: dict) -> tuple[dict[int, int], int]:
    """A transformer's tensor bytes split into {stacked block index: bytes} and the bytes outside the
    blocks (its config names the family, whose adapter names the block lists)."""
    blocks: dict[int, int] = {}
    shared = 0
    for key, size in tensors.items():
        index = block_index(transformer_config, key)
        if index is not None:
            blocks[index] = blocks.get(index, 0) + size
        else:
            shared += size
    return blocks, shared


def tp_local(weights: Weights, tp: int) -> Weights:
    """A transformer as one tp rank holds it: each tensor its plan splits (by the header's names:
    families/tp_plan.split_dim) with 1/tp of its split dim, every other whole; what FSDP2 then shards over the
    weights group (shard_weights with tp) is this."""
    import dataclasses

    import diffusers

    from ..families.tp_plan import split_dim

    dim_of = split_dim(getattr(diffusers, weights.class_name), FAMILIES[weights.class_name])

    def local(tensor):
        dim = dim_of(tensor.name)
        if dim is None:
            return tensor
        shape = list(tensor.shape)
        shape[dim] //= tp
        return dataclasses.replace(tensor, shape=tuple(shape))

    return dataclasses.replace(
        weights, root=[local(t) for t in weights.root], blocks=[[local(t) for t in block] for block in weights.blocks]
    )


def stage_spans(config, blocks: int) -> list[tuple[int, int]]:
    """The blocks [start, stop) of each PipeFusion stage (one span of all of them without PipeFusion, or for a
    split PipeFusion cannot make, which load_pipeline refuses later with its reason)."""
    try:
        return config.stage_ranges(blocks)
    except ValueError:
        return [(0, blocks)]


def offload_spans(weights: Weights, span: tuple[int, int], blocks_at_once: int) -> list[tuple[int, int]]:
    """The stacked blocks [start, stop) of each group diffusers' group offloading makes of blocks `span` (a
    PipeFusion stage's, or all): `blocks_at_once` consecutive blocks of one list at a time, each list cut from
    its first held block (Flux: its double-stream blocks, then its single-stream ones, apart)."""
    names = FAMILIES[weights.class_name].block_names(weights.config)
    spans, start = [], span[0]
    for index in range(span[0], span[1] + 1):
        ends_list = index == span[1] or names[index].rsplit(".", 1)[0] != names[start].rsplit(".", 1)[0]
        if ends_list or index - start == blocks_at_once:
            if index > start:
                spans.append((start, index))
            start = index
    return spans


@dataclass(frozen=True)
class Offloaded:
    """A transformer's weights under offload_blocks, as one rank holds them for blocks `span`: on the device at
    most (the root's group and the largest group of blocks), in host memory the rest, and what crosses to the
    device per call."""

    device: int
    host: int
    root: int  # the root's own group: moved once per transformer call
    blocks: int  # every group of blocks: moved once per run of the model's forward (per patch in a PipeFusion stage)

    @classmethod
    def of(cls, weights: Weights, span: tuple[int, int], blocks_at_once: int, scheme: str | None = None) -> Offloaded:
        """diffusers groups every list among the model's children (nn.ModuleList, nn.Sequential: a tensor name
        `child.<i>.`), not only the adapter's block lists (Z-Image's refiners): those are groups of blocks_at_once
        elements too, cut from their first; the rest of the root is one group."""
        adapter = FAMILIES[weights.class_name]
        names = [key for key in weights.names if adapter.block_index(key, weights.config) is None]  # weights.root's
        root, lists = 0, {}
        for key, tensor in zip(names, weights.root, strict=True):
            held = tensor.held_bytes(1, scheme)
            listed = re.match(r"([^.]+)\.(\d+)\.", key)
            if listed:
                group = (listed[1], int(listed[2]) // blocks_at_once)
                lists[group] = lists.get(group, 0) + held
            else:
                root += held
        each = [sum(t.held_bytes(1, scheme) for t in block) for block in weights.blocks]
        groups = [sum(each[a:b]) for a, b in offload_spans(weights, span, blocks_at_once)] + list(lists.values())
        blocks = sum(each[span[0] : span[1]]) + sum(lists.values())
        largest = max(groups, default=0)
        return cls(device=root + largest, host=blocks - largest, root=root, blocks=blocks)

    def moved_per_step(self, runs: int) -> int:
        """Bytes host to device per denoising step when the model's forward runs `runs` times in one transformer
        call (PipeFusion's patches)."""
        return self.root + runs * self.blocks


def held_weights(
    model: ModelFolder,
    config,
    shard: bool,
    placement,
    stale=None,
    scheme: str | None = None,
    quantized=(),
    offload: int | None = None,
) -> tuple[dict, int, int, int, int, Offloaded | None]:
    """What one rank holds of each component's weights under `config`: ({component: bytes on this rank's
    device}, the gather buffer, the busiest stage's stale K/V (from `stale(span)`, if given), bytes all-gathered
    per request for sharded text encoders, bytes kept in host memory (text encoders, an offloaded transformer's),
    the busiest expert's Offloaded figures or None). The transformer
    sharded over the ranks of a stage (world / pipefusion) when `shard`; text encoders whole ("gpu"),
    sharded over the world ("sharded") or in host memory ("host"): one placement for all, or a dict of
    them by component (missing ones: "gpu"); the rest whole on every rank. With `scheme`, the components in
    `quantized` hold their linear weights quantized (quantization.py; never with `shard`). With `offload` (N,
    never with `shard`), the transformer's blocks are in host memory, N at a time on the device (Offloaded): only
    the running expert is on the device, so Wan 2.2 A14B's second expert adds nothing there."""
    world = config.world_size
    shards = world // (config.pipefusion * config.tp) if shard else 1  # the weights group
    # Wan 2.2 A14B's second expert is held as the first: the same stage of its blocks, sharded or quantized alike;
    # under tp each as one tp rank holds it, which FSDP2 shards further
    experts = [(name, model.weights[name]) for name in model.named(TRANSFORMER, EXPERT)]
    if config.tp > 1:  # a stage's blocks as its tp rank holds them; never quantized: parallelize refuses it with tp
        experts = [(name, tp_local(w, config.tp)) for name, w in experts]
    per_stage = []  # ({expert: weights}, gather, stale K/V, host, offloaded) of each stage: the busiest is planned
    for span in stage_spans(config, len(model.transformer.blocks)):
        kept = stale(span) if stale is not None and config.pipefusion > 1 else 0  # one expert's: the other freed
        host, offloaded = 0, None
        if offload:
            each = {name: Offloaded.of(w, span, offload, scheme if name in quantized else None) for name, w in experts}
            offloaded = max(each.values(), key=lambda o: o.device)
            held = {name: offloaded.device if name == experts[0][0] else 0 for name, _ in experts}
            host = sum(o.device + o.host for o in each.values()) - offloaded.device
        else:
            held = {name: w.held(shards, span, scheme if name in quantized else None) for name, w in experts}
        gather = max(w.gather(shards, span) for _, w in experts)  # one expert runs at a time: one gather buffer
        per_stage.append((held, gather, kept, host, offloaded))
    held, gather, kept, host, offloaded = max(per_stage, key=lambda stage: sum(stage[0].values()) + stage[1] + stage[2])
    weights = dict(held)
    encode_gather, encoder_gathers = 0, [0]
    for name in model.text_encoders:
        encoder = model.weights[name]
        where = placement.get(name, "gpu") if isinstance(placement, dict) else placement
        held = encoder.held(1, scheme=scheme if name in quantized else None)  # whole, or quantized
        if where == "gpu":
            weights[name] = held
        elif where == "sharded":
            weights[name] = encoder.held(world)
            encoder_gathers.append(encoder.gather(world))
            encode_gather += encoder.whole * (world - 1) // world
        else:
            weights[name] = 0
            host += held
    for name, component in model.weights.items():
        weights.setdefault(name, component.whole)  # the VAE and anything else: whole on every rank
    return weights, max(gather, *encoder_gathers), kept, encode_gather, host, offloaded
