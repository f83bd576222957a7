"""Writing header-only folders: configs as the classes save them, safetensors headers whose data is a
sparse hole, every file under a temporary name first and then renamed into place."""

from __future__ import annotations

import copy
import json
import os
import struct
import tempfile
from pathlib import Path

import torch

from .table import REAL_MODELS, Component

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
SHARD_BYTES = 10 * 10**9  # split a component's weights into files of at most this many bytes (diffusers' "10GB")


def save_header_only(name: str, folder) -> Path:
    """Write the header-only diffusers folder of the real model `name` (a key of REAL_MODELS) into
    `folder` and return it. Existing files of the same names are replaced (each atomically)."""
    if name not in REAL_MODELS:
        raise ValueError(f"no real model {name!r}; known: {', '.join(REAL_MODELS)}")
    model = REAL_MODELS[name]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    import diffusers

    index = {"_class_name": model.pipeline_class, "_diffusers_version": diffusers.__version__, **model.settings}
    listed = {part: [c.library, c.class_name] for part, c in model.components.items()}
    listed.update({part: list(where) for part, where in model.listed_only.items()})
    index.update(sorted(listed.items()))
    for component_name, component in model.components.items():
        _save_component(component, folder / component_name)
    _write_atomically(folder / "model_index.json", json.dumps(index, indent=2, sort_keys=False) + "\n")
    if model.call_defaults:
        _write_atomically(folder / "call_defaults.json", json.dumps(model.call_defaults, indent=2) + "\n")
    return folder


def build_on_meta(component: Component) -> torch.nn.Module:
    """The component's module with every parameter and buffer on the meta device (shapes, no memory).
    The classes get a copy of the arguments: transformers' configs fill in nested dicts they are given
    (Qwen2.5-VL's rope_scaling), which would change REAL_MODELS and every later folder."""
    library = _library(component.library)
    cls = getattr(library, component.class_name)
    kwargs = copy.deepcopy(component.kwargs)
    with torch.device("meta"):
        if component.config_class is None:
            return cls(**kwargs)
        return cls(getattr(library, component.config_class)(**kwargs))


def _library(name: str):
    """diffusers, transformers, or a diffusers pipeline's own module, as model_index.json names it (LTX-2's
    "ltx2": its text connectors and vocoder live in diffusers.pipelines.ltx2)."""
    import importlib

    return importlib.import_module(name if name in ("diffusers", "transformers") else f"diffusers.pipelines.{name}")


def stored_tensors(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, tuple[str, list[int]]]:
    """{name: (safetensors dtype, shape)} of what save_pretrained stores: the state dict (parameters
    and persistent buffers), each tensor once under its first name (tied weights), floating tensors
    in the stored `dtype`."""
    stored, seen = {}, set()
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        element_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        stored[key] = (SAFETENSORS_DTYPES[element_dtype], list(tensor.shape))
    return stored


def _save_component(component: Component, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if component.dtype is None:  # a scheduler: its configuration only
        import diffusers

        scheduler = getattr(diffusers, component.class_name)(**component.kwargs)
        _save_config(lambda where: scheduler.save_config(where), path, "scheduler_config.json")
        return
    module = build_on_meta(component)
    if component.library != "transformers":  # diffusers' models, a diffusers pipeline's own ones too
        _save_config(lambda where: module.save_config(where), path, "config.json")
        stem = "diffusion_pytorch_model"
    else:  # what PreTrainedModel.save_pretrained sets before it saves the configuration
        module.config.dtype = str(component.dtype).removeprefix("torch.")
        module.config.architectures = [type(module).__name__]
        _save_config(lambda where: module.config.save_pretrained(where), path, "config.json")
        stem = "model"
    write_header_only_weights(path, stem, stored_tensors(module, component.dtype))


def write_header_only_weights(path: Path, stem: str, tensors: dict[str, tuple[str, list[int]]]) -> list[Path]:
    """Header-only safetensors files of `tensors` in `path`: one `stem.safetensors`, or shards of at
    most SHARD_BYTES named and indexed as diffusers and transformers name theirs."""
    shards: list[dict] = [{}]
    size = 0
    for key, (dtype, shape) in tensors.items():
        nbytes = _nbytes(dtype, shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = (dtype, shape)
        size += nbytes
    if len(shards) == 1:
        names = [f"{stem}.safetensors"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
        total = sum(_nbytes(*value) for value in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_atomically(path / f"{stem}.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    for name, shard in zip(names, shards):
        write_header_only_safetensors(path / name, shard)
    return [path / name for name in names]


def write_header_only_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """One safetensors file whose data is a sparse hole: the 8-byte little-endian header length, the
    JSON header (tensors laid out largest element first, then by name, as safetensors lays them out,
    so every tensor is aligned), padded with spaces to 8 bytes, then truncate() to the full length.
    Returns the data bytes."""
    width = {name: _element_bytes(dtype) for name, (dtype, _) in tensors.items()}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in sorted(tensors, key=lambda k: (-width[k], k)):
        dtype, shape = tensors[key]
        end = offset + _nbytes(dtype, shape)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    temporary = _temporary_name(path)
    try:
        with open(temporary, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            f.truncate(8 + len(text) + offset)  # the data: a hole, no disk blocks
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return offset


def _save_config(save, path: Path, filename: str) -> None:
    """Let the class write its own configuration into a temporary folder beside `path`, then rename
    the file into place."""
    with tempfile.TemporaryDirectory(dir=path, prefix=".config-") as where:
        save(where)
        os.replace(Path(where) / filename, path / filename)


def _write_atomically(path: Path, text: str) -> None:
    temporary = _temporary_name(path)
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


_ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _element_bytes(dtype: str) -> int:
    return _ELEMENT_BYTES[dtype]


def _nbytes(dtype: str, shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _element_bytes(dtype)
