"""The weight planner: what one rank holds of each component's weights, from the safetensors headers alone
(the load's ModelFolder, parsed once), in every case a load places them:

    whole          every component on every rank, at the load dtype
    a stage        PipeFusion: the busiest stage's transformer blocks (and the expert's), plus everything
                   outside the blocks (embeddings, output layers), which every stage keeps
    an FSDP2 shard shard_weights: torch.chunk's largest piece of every parameter (buffers whole) over the
                   ranks that hold the same blocks; text encoders over the world; plus the gather buffer
    host-placed    a text encoder kept in host memory: nothing on the device
    quantized      a named scheme's linear weights (int8, float8): a byte per element and a scale per row

Only the components whose role moves are moved (model_folder.component_role): the transformer and the expert
are cut into stages, sharded or quantized, the text encoders sharded, host-placed or quantized; an image
encoder, a ControlNet and the VAE are whole on every rank, as diffusers loads them.

A safetensors file starts with an 8-byte little-endian header length and a JSON header giving every tensor's
dtype, shape and byte range, so sizes are known without reading weights (tensor_bytes, component_tensor_bytes:
the figures the lessons and the tests read a header by).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..families import block_index
from ..model_folder import EXPERT, TRANSFORMER, ModelFolder
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


def stage_spans(config, blocks: int) -> list[tuple[int, int]]:
    """The blocks [start, stop) of each PipeFusion stage (one span of all of them without PipeFusion, or for a
    split PipeFusion cannot make, which load_pipeline refuses later with its reason)."""
    try:
        return config.stage_ranges(blocks)
    except ValueError:
        return [(0, blocks)]


def held_weights(
    model: ModelFolder, config, shard: bool, placement, stale=None, scheme: str | None = None, quantized=()
) -> tuple[dict, int, int, int, int]:
    """What one rank holds of each component's weights under `config`: ({component: bytes on this rank's
    device}, the gather buffer, the busiest stage's stale K/V (from `stale(span)`, if given), bytes all-gathered
    per request for sharded text encoders, bytes of text encoders kept in host memory). The transformer
    sharded over the ranks of a stage (world / pipefusion) when `shard`; text encoders whole ("gpu"),
    sharded over the world ("sharded") or in host memory ("host"): one placement for all, or a dict of
    them by component (missing ones: "gpu"); the rest whole on every rank. With `scheme`, the components in
    `quantized` hold their linear weights quantized (quantization.py; never with `shard`)."""
    world = config.world_size
    shards = world // config.pipefusion if shard else 1
    # Wan 2.2 A14B's second expert is held as the first: the same stage of its blocks, sharded or quantized alike
    experts = [(name, model.weights[name]) for name in model.named(TRANSFORMER, EXPERT)]
    per_stage = []  # ({expert: weights}, gather, stale K/V) of each stage: the busiest is planned
    for span in stage_spans(config, len(model.transformer.blocks)):
        kept = stale(span) if stale is not None and config.pipefusion > 1 else 0  # one expert's: the other freed
        held = {name: w.held(shards, span, scheme if name in quantized else None) for name, w in experts}
        gather = max(w.gather(shards, span) for _, w in experts)  # one expert runs at a time: one gather buffer
        per_stage.append((held, gather, kept))
    held, gather, kept = max(per_stage, key=lambda stage: sum(stage[0].values()) + stage[1] + stage[2])
    weights = dict(held)
    encode_gather, host, encoder_gathers = 0, 0, [0]
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
    return weights, max(gather, *encoder_gathers), kept, encode_gather, host
