"""Streamed per-rank loading: a rank reads from safetensors only the bytes it will hold.

    with init_empty_weights():                      # accelerate: parameters on meta, buffers real
        model = FluxTransformer2DModel.from_config(config)
    for block in model.transformer_blocks: fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)                   # every parameter a DTensor, Shard(0) over N ranks
    materialize(model, "cpu")                       # storage for this rank's chunks only
    load_weights(model, folder, dtype=torch.float32)

A tensor is stored row-major, so the rows of dim 0 that FSDP2 gives a rank (torch.chunk: ceil(rows/N)
on the first ranks, fewer or none on the last) are one contiguous byte range of the file:

    file   | header |  w0 (rows 0..R)                 | w1 (rows 0..S)          | bias ... |
    rank 0          |  rows 0..ceil(R/2) ------       |  rows 0..ceil(S/2) ---  | whole    |
    rank 1          |        ------- rows ceil(R/2)..R|        --- the rest     | whole    |

`load_weights` reads exactly those ranges with `os.preadv` at the header's offsets, in chunks of at
most `chunk_bytes`, straight into the rank's local storage when the dtype already matches (no copy
at all), else through one bounded staging buffer that is cast chunk by chunk. A plain tensor (not a
DTensor: a buffer, or a module that is not sharded) is read whole. No file is ever mapped, so an
address-space limit or a file system that refuses mmap ("Unable to mmap 9989150328 bytes": every
rank mapping a 10 GB shard whole) cannot stop it, and a rank's host memory grows by its own shard.

Why not torch's own `torch.distributed.checkpoint.load(model.state_dict(),
storage_reader=HuggingFaceStorageReader(folder))` (torch 2.13)? It gives the same values and it
does copy only each rank's rows, but it opens every file with safetensors' `safe_open`, which maps
the file whole, and reads the rows through that mapping. Measured on 2 gloo ranks, 320 MiB of
float32 weights in two files (benchmarks/shard_loading.py; the first and last rows also in
tests/test_shard_loading.py), the rise of a rank's peak resident set during the load:

    reader                                    peak rise / shard   rchar        mmap of whole files
    materialize + load_weights (this module)  1.01                = its shard  none
    torch DCP + HuggingFaceStorageReader      1.53                ~0           every file, while read
    safetensors load_file, each tensor read   2.01 (the whole)    ~0           every file

The target, shard + the largest tensor + 10%, is 1.32 shards there: DCP misses it (the pages
of its mapped rows stay resident beside the copies until the file is closed), and under an
address-space limit that fits the shard but not a whole file it fails with the error this
module exists to avoid ("unable to mmap 167830384 bytes"), while this module loads. DCP also takes every `*.safetensors` in the
folder (no index.json, so variants mix in), cannot rename keys (a PipeFusion stage renames its
blocks) and ignores checkpoint keys the module lacks. So this module reads the files itself.
(safetensors 0.8's `safe_open(..., backend="pread")` does not map, but its `get_slice` reads the
whole tensor before slicing it, and the project supports safetensors from 0.4.)

`materialize`, not `module.to_empty()`: to_empty replaces every tensor, so the non-persistent
buffers computed at construction (PixArt's and CogVideoX's position tables, Wan's rotary tables,
in no checkpoint) come back as uninitialised memory, and tied weights come back untied.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .safetensors_io import (
    CHUNK_BYTES,
    SAFETENSORS_DTYPES,
    checked_header,
    itemsize,
    numel,
    read_into,
    safetensors_files,
)

SHOWN = 8  # problems listed in one error; the rest are counted


class WeightsMismatchError(ValueError):
    """The files and the module disagree: a key one side lacks, a shape, a dtype."""


@dataclass
class LoadReport:
    """What load_weights did on this rank."""

    files: list[Path]
    tensors: int = 0  # tensors written (a tied tensor once)
    bytes_read: int = 0  # bytes read from the files (this rank's rows of sharded tensors, plain ones whole)
    skipped: list[str] = field(default_factory=list)  # file keys rename mapped to None


# ---- materialize ------------------------------------------------------------------------------------------------


@torch.no_grad()
def materialize(module: torch.nn.Module, device, *, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Give every meta parameter and meta persistent buffer of `module` real (uninitialised) storage
    on `device`: a DTensor its local shard (what `p.to_local()` holds on this rank), a plain tensor
    the whole; floats in `dtype` when given. Real tensors keep their values and dtype (accelerate's
    `init_empty_weights()` keeps buffers real, and computed tables must survive); a non-persistent
    buffer on meta (built under `torch.device("meta")`) is in no file, so it is refused by name.

    Parameters are swapped in place (torch.utils.swap_tensors): tied weights stay tied (to_empty
    makes a new Parameter per name) and FSDP2 keeps its reference to each DTensor. FSDP2 then
    re-pads each shard before anything is written, so load_weights writes into the storage FSDP
    all-gathers from. Returns `module`."""
    device = torch.device(device)
    lost = [
        f"{prefix}{'.' if prefix else ''}{name}"
        for prefix, sub in module.named_modules()
        for name, buffer in sub._buffers.items()
        if buffer is not None and buffer.is_meta and name in sub._non_persistent_buffers_set
    ]
    if lost:
        raise WeightsMismatchError(
            f"{type(module).__name__} has non-persistent buffers on meta: {', '.join(lost[:SHOWN])}"
            f"{_more(lost)}. Their values were computed when the module was built and no checkpoint holds "
            f"them. Build the module under accelerate's init_empty_weights() (parameters on meta, buffers "
            f"real) instead of torch.device('meta')."
        )

    def empty_like(tensor):
        wanted = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return torch.empty_like(tensor, device=device, dtype=wanted)

    done: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its replacement (a tied tensor once)
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is None or not param.is_meta or id(param) in done:
                continue
            # swapped in place (the Parameter object stays): FSDP2's reference and tied weights hold
            torch.utils.swap_tensors(param, torch.nn.Parameter(empty_like(param), requires_grad=param.requires_grad))
            done[id(param)] = param
        for name, buffer in sub._buffers.items():
            if buffer is None or not buffer.is_meta:
                continue
            if id(buffer) not in done:
                done[id(buffer)] = empty_like(buffer)
            sub._buffers[name] = done[id(buffer)]
    _repad_fsdp_shards(module)
    return module


def _repad_fsdp_shards(module: torch.nn.Module) -> None:
    """FSDP2 keeps each shard in a flat buffer padded to ceil(rows/N) rows on every rank, with the
    parameter's local tensor a view of it. After new storage is swapped in, torch's own
    `FSDPModule._apply` calls `reset_sharded_param()` on every FSDP parameter to re-pad and re-point
    (torch 2.13); the same call is made here, so loading writes into the final storage. Without it
    (a torch whose internals moved) FSDP does it at its first forward, copying uneven shards once."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state() if hasattr(sub, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_sharded_param()


def _more(items: list) -> str:
    return f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""


# ---- load_weights -----------------------------------------------------------------------------------------------


@dataclass
class _Item:
    file: Path
    file_key: str
    name: str  # in the module
    info: dict  # the header's entry


def load_weights(
    module: torch.nn.Module,
    folder_or_files,
    *,
    dtype: torch.dtype | None,
    rename: Callable[[str], str | None] | Mapping[str, str | None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    header: Callable[[Path], dict] | None = None,
) -> LoadReport:
    """Fill every parameter and persistent buffer of `module` (its `state_dict()` keys) from the
    component's safetensors files, reading only what this rank keeps, in place.

    - a DTensor sharded on dim 0 (FSDP2's `Shard(0)`, possibly with `Replicate` on other mesh
      dims): the rows of this rank's chunk, one contiguous byte range, written into `to_local()`;
    - any other tensor: the whole tensor.

    Floats are cast to `dtype` (`None`: each tensor's own); a parameter of another float dtype is
    refused (materialize(..., dtype=) makes them `dtype`), a plain buffer of another (accelerate keeps
    buffers real, float32) is replaced by one in `dtype`, as diffusers' from_pretrained does.

    `rename` maps a file key to the module's name: a callable, or a mapping (a key it lacks keeps its
    name); None skips the key (a PipeFusion stage's other blocks). Every disagreement between files
    and module is raised at once, before any data is read, with the file, the key and the fix; a
    corrupt header raises safetensors_io.CorruptWeightsError. `header`: a file's tensor table, parsed once
    elsewhere (ModelFolder.header); by default each file's header is read here. Call materialize first."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian data; this reader runs on little-endian hosts only")
    files = safetensors_files(folder_or_files)
    targets = module.state_dict(keep_vars=True)  # params and persistent buffers; FSDP2: the sharded DTensors
    buffer_names = _persistent_buffer_names(module)
    names_of: dict[int, list[str]] = {}  # tied tensors share one object: any of its names fills it
    for name, tensor in targets.items():
        names_of.setdefault(id(tensor), []).append(name)

    report = LoadReport(files=files)
    headers: dict[Path, int] = {}
    items: dict[int, _Item] = {}
    unexpected, duplicated, problems = [], [], []
    for file in files:
        data_start, tensors = checked_header(file, header)
        headers[file] = data_start
        for file_key, info in tensors.items():
            name = _renamed(rename, file_key)
            if name is None:
                report.skipped.append(file_key)
                continue
            if name not in targets:
                shown = file_key if name == file_key else f"{file_key!r} (renamed {name!r})"
                unexpected.append(f"{file.name}: {shown}")
                continue
            tensor = targets[name]
            if id(tensor) in items:
                earlier = items[id(tensor)]
                duplicated.append(
                    f"{name!r} from {earlier.file.name}: {earlier.file_key!r} and from {file.name}: {file_key!r}"
                )
                continue
            items[id(tensor)] = _Item(file, file_key, name, info)
            problems += _mismatches(file, file_key, info, name, tensor, dtype, name in buffer_names)

    missing = [names[0] for key, names in names_of.items() if key not in items]
    _raise_mismatches(module, files, unexpected, duplicated, missing, problems)

    by_file: dict[Path, list[_Item]] = {}
    for item in items.values():
        by_file.setdefault(item.file, []).append(item)
    with torch.no_grad():
        for file, file_items in by_file.items():
            fd = os.open(file, os.O_RDONLY)
            try:
                for item in sorted(file_items, key=lambda i: i.info["data_offsets"][0]):  # front to back
                    target = _target(module, item.name, targets[item.name], dtype)
                    report.bytes_read += _read_item(fd, headers[file], item, target, chunk_bytes)
                    report.tensors += 1
            finally:
                os.close(fd)
    return report


def _renamed(rename, file_key: str) -> str | None:
    if rename is None:
        return file_key
    if isinstance(rename, Mapping):
        return rename.get(file_key, file_key)
    return rename(file_key)


def _persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    return {
        f"{prefix}{'.' if prefix else ''}{name}"
        for prefix, sub in module.named_modules(remove_duplicate=False)
        for name, buffer in sub._buffers.items()
        if buffer is not None and name not in sub._non_persistent_buffers_set
    }


def _mismatches(file, file_key, info, name, tensor, dtype, is_buffer) -> list[str]:
    """What keeps this file tensor from filling this module tensor (empty: nothing)."""
    where = f"{file.name}: {file_key!r}" + ("" if file_key == name else f" (as {name!r})")
    found = []
    if list(info["shape"]) != list(tensor.shape):
        found.append(
            f"{where} has shape {tuple(info['shape'])} in the file but {tuple(tensor.shape)} in the module: the "
            f"config that built the module does not match these weights (build it from the folder's own config.json)"
        )
    file_float = SAFETENSORS_DTYPES[info["dtype"]].is_floating_point
    if file_float != tensor.is_floating_point():
        found.append(
            f"{where} is {info['dtype']} in the file but {tensor.dtype} in the module: a float cannot fill an "
            f"integer tensor or the reverse"
        )
    elif file_float and dtype is not None and tensor.dtype != dtype and not (is_buffer and not _is_dtensor(tensor)):
        found.append(
            f"{where}: the module's tensor is {tensor.dtype}, not the dtype={dtype} asked for; "
            f"materialize(module, device, dtype={dtype}) makes meta parameters {dtype} (or pass dtype=None "
            f"to load each tensor in its own dtype)"
        )
    if tensor.is_meta or (_is_dtensor(tensor) and tensor.to_local().is_meta):
        found.append(f"{where}: the module's tensor is still on meta; call materialize(module, device) first")
    if _is_dtensor(tensor):
        try:
            rows_of_this_rank(tensor, repr(name))
        except WeightsMismatchError as error:
            found.append(f"{file.name}: {error}")
    return found


def _raise_mismatches(module, files, unexpected, duplicated, missing, problems) -> None:
    if not (unexpected or duplicated or missing or problems):
        return
    folder = files[0].parent
    lines = []
    if unexpected:
        lines.append(
            f"{len(unexpected)} key(s) in the files that {type(module).__name__} does not have: "
            f"{'; '.join(unexpected[:SHOWN])}{_more(unexpected)}. Pass rename= to map file keys to module names "
            f"(None skips a key), or load the weights saved for this module"
        )
    if duplicated:
        lines.append(
            f"{len(duplicated)} tensor(s) found twice: {'; '.join(duplicated[:SHOWN])}{_more(duplicated)}. The "
            f"folder holds two saves of the model: pass its index.json or the files of one save"
        )
    if missing:
        lines.append(
            f"{len(missing)} parameter(s) or persistent buffer(s) of {type(module).__name__} in no file of "
            f"{folder} ({', '.join(f.name for f in files)}): {', '.join(missing[:SHOWN])}{_more(missing)}. They "
            f"would stay uninitialised: load the checkpoint saved for this config, or map the files' names for "
            f"them with rename="
        )
    lines += problems[:SHOWN] + ([f"and {len(problems) - SHOWN} more such problem(s)"] if len(problems) > SHOWN else [])
    raise WeightsMismatchError(f"cannot load {folder} into {type(module).__name__}:\n  - " + "\n  - ".join(lines))


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support has no DTensors
        return False
    return isinstance(tensor, DTensor)


def _target(module, name: str, tensor, dtype):
    """The tensor to write into: a DTensor's local shard, else the tensor; a real float buffer of
    another dtype is first replaced by an empty one in `dtype`, in every module that holds it."""
    if _is_dtensor(tensor):
        return tensor
    if (
        dtype is not None
        and tensor.is_floating_point()
        and tensor.dtype != dtype
        and not isinstance(tensor, torch.nn.Parameter)
    ):
        new = torch.empty_like(tensor, dtype=dtype)
        for sub in module.modules():
            for key, buffer in sub._buffers.items():
                if buffer is tensor:
                    sub._buffers[key] = new
        return new
    return tensor


def rows_of_this_rank(tensor, name: str = "tensor") -> tuple[int, int]:
    """(first row, rows) of dim 0 that this rank holds of a DTensor: torch.chunk over each mesh dim
    that shards dim 0 (ceil(rows/N) on the first ranks), nested in mesh order, as DTensor does.
    Checked against the local tensor's shape; any other placement is refused."""
    from torch.distributed.tensor import Replicate, Shard

    first, rows = 0, tensor.shape[0] if tensor.dim() else 1
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard or placement.dim != 0:
            raise WeightsMismatchError(
                f"{name} is placed {tensor.placements} on its mesh: only dim-0 sharding (FSDP2's Shard(0)) and "
                f"replication are read as row ranges; gather it or shard it with fully_shard"
            )
        ranks, rank = tensor.device_mesh.size(mesh_dim), tensor.device_mesh.get_local_rank(mesh_dim)
        chunk = -(-rows // ranks)
        start = min(rank * chunk, rows)
        first, rows = first + start, min(chunk, rows - start)
    local = tensor.to_local()
    if tensor.dim() and (local.shape[0] != rows or local.shape[1:] != tensor.shape[1:]):
        raise WeightsMismatchError(
            f"{name}: this rank holds {tuple(local.shape)} of {tuple(tensor.shape)}, not the {rows} rows torch.chunk "
            f"gives it; only even torch.chunk sharding (FSDP2's) is read as row ranges"
        )
    return first, rows


def _read_item(fd: int, data_start: int, item: _Item, target, chunk_bytes: int) -> int:
    """Read this rank's part of one tensor into `target` (a DTensor: its local shard); the bytes read."""
    info = item.info
    begin = data_start + info["data_offsets"][0]
    if _is_dtensor(target):
        first, rows = rows_of_this_rank(target, repr(item.name))
        row_bytes = numel(info["shape"][1:]) * itemsize(info["dtype"])
        begin, nbytes = begin + first * row_bytes, rows * row_bytes
        local = target.to_local()
    else:
        nbytes, local = info["data_offsets"][1] - info["data_offsets"][0], target
    if nbytes == 0:
        return 0
    read_into(
        fd, begin, nbytes, SAFETENSORS_DTYPES[info["dtype"]], local, chunk_bytes, f"{item.file}: {item.file_key!r}"
    )
    return nbytes


def transformers_key_renaming(model):
    """file key -> module key, as transformers' from_pretrained renames a checkpoint's keys for `model`
    (transformers 5's conversion mapping: Mistral 3's and Qwen2.5-VL's published keys differ from their
    modules'); None where this transformers release has no such mapping. A conversion that changes
    tensors (not only names) cannot be read row by row: refused by name."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # transformers 4: checkpoint keys are the module's
        return None
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if converters:
        raise NotImplementedError(
            f"{type(model).__name__}'s checkpoint is converted tensor by tensor when transformers loads it "
            f"({type(converters[0]).__name__}), which a rank reading only its own rows cannot do; load it "
            f"without shard_weights, or keep it on the host (on_host=...)"
        )
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    keys = model.state_dict()

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, [], model.base_model_prefix, keys)[0]

    return rename
