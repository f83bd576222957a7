"""Plain reads of safetensors files: which files a component has, each header checked, and byte
ranges read into a tensor with bounded `os.preadv` calls. Nothing here maps a file.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and `data_offsets` from the end of the header), then the tensors' bytes, row-major.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DEFAULT_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")  # diffusers', transformers' unsharded
CHUNK_BYTES = 16 * 2**20  # the most one read (and the staging buffer of a cast) holds


class CorruptWeightsError(ValueError):
    """A safetensors file that cannot be what it claims to be."""


def read_safetensors_header(path: Path) -> dict:
    """The tensor table of a safetensors file, checked before any byte of data is read: the header's length
    and JSON, each tensor's dtype and byte count against its shape, and that no tensor runs past the end
    of the file (a truncated copy is named here, not deep inside a loader)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptWeightsError(
                f"{path} is not a safetensors file: {size} bytes, shorter than its header; save or copy it again"
            )
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CorruptWeightsError(
                f"{path} is truncated or corrupt: its header claims {header_len:,} bytes but "
                f"the file has {size:,}; save or copy it again"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CorruptWeightsError(
                f"{path} has a corrupt safetensors header ({error}); save or copy it again"
            ) from None
    if not isinstance(header, dict):
        raise CorruptWeightsError(
            f"{path} has a corrupt safetensors header (a JSON {type(header).__name__}, not an object of tensors); "
            f"save or copy it again"
        )
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for key, info in tensors.items():
        if not _well_formed(info):
            raise CorruptWeightsError(
                f"{path} has a corrupt safetensors header: {key!r} is {str(info)[:120]}, not a tensor's dtype, shape "
                f"and data_offsets; save or copy it again"
            )
    data_end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + header_len + data_end > size:
        last = max(tensors, key=lambda k: tensors[k]["data_offsets"][1])  # the tensor that runs past the end
        raise CorruptWeightsError(
            f"{path} is truncated: its header promises {data_end:,} bytes of tensors (up to the end of "
            f"{last!r}), the file holds {size - 8 - header_len:,}; save or copy it again"
        )
    for key, info in tensors.items():
        if info.get("dtype") not in SAFETENSORS_DTYPES:
            raise CorruptWeightsError(
                f"{path}: {key!r} has dtype {info.get('dtype')!r}, which this reader does not know "
                f"(it reads {', '.join(SAFETENSORS_DTYPES)})"
            )
        start, stop = info["data_offsets"]
        expected = numel(info["shape"]) * itemsize(info["dtype"])
        if stop - start != expected:
            raise CorruptWeightsError(
                f"{path}: {key!r} is {info['dtype']} {info['shape']} ({expected:,} bytes) but its header gives it "
                f"{stop - start:,} bytes; the file is corrupt: save or copy it again"
            )
    return tensors


def _well_formed(info) -> bool:
    """A header entry with a dtype name, a shape of sizes and data_offsets [start, stop] (start <= stop)."""

    def sizes(value, length=None):
        return (
            isinstance(value, list)
            and (length is None or len(value) == length)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        )

    return (
        isinstance(info, dict)
        and isinstance(info.get("dtype"), str)
        and sizes(info.get("shape"))
        and sizes(info.get("data_offsets"), 2)
        and info["data_offsets"][0] <= info["data_offsets"][1]
    )


def safetensors_files(source) -> list[Path]:
    """The safetensors files of one component: a file; an `*.safetensors.index.json` (the files its
    weight_map names); a folder (its index when it has one, else its one default file
    `diffusion_pytorch_model.safetensors` or `model.safetensors` when it has one beside variants,
    else every `*.safetensors` in it); or a list of files."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            indexes = sorted(path.glob("*.safetensors.index.json"))
            if len(indexes) > 1:
                raise FileNotFoundError(
                    f"{path} has {len(indexes)} safetensors indexes ({', '.join(i.name for i in indexes)}): "
                    f"pass the one to load"
                )
            if indexes:
                return _indexed_files(indexes[0])
            for name in DEFAULT_NAMES:  # beside variants (name.fp16.safetensors), the default, as diffusers takes
                if (path / name).is_file():
                    return [path / name]
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{path} holds no *.safetensors file: pass the folder of the component's weights"
                )
            return files
        if path.name.endswith(".index.json"):
            return _indexed_files(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        return [path]
    files = [Path(f) for f in source]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} does not exist")
    return files


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise CorruptWeightsError(
            f"{index} is not a safetensors index (no weight_map: {error!r}); copy the folder again"
        ) from None
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(
                f"{index} names {f.name}, which is not in {index.parent}: copy the whole folder again"
            )
    return files


def checked_header(path: Path, header=None) -> tuple[int, dict]:
    """(where the data starts, the tensor table read_safetensors_header checked; `header`: one already
    parsed, as ModelFolder.header keeps them)."""
    tensors = (header or read_safetensors_header)(path)
    with open(path, "rb") as f:
        data_start = 8 + struct.unpack("<Q", f.read(8))[0]
    return data_start, tensors


def numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def itemsize(safetensors_dtype: str) -> int:
    return torch.empty((), dtype=SAFETENSORS_DTYPES[safetensors_dtype]).element_size()


def read_into(
    fd: int, offset: int, nbytes: int, source_dtype: torch.dtype, dest: torch.Tensor, chunk_bytes: int, what: str
) -> None:
    """Read `nbytes` at `offset` of the open file `fd` (elements of `source_dtype`) into `dest`, in
    preadv calls of at most `chunk_bytes`: straight into `dest`'s memory when it is a contiguous CPU
    tensor of that dtype (no copy at all), else through one staging buffer of at most `chunk_bytes`,
    cast (or copied to its device) chunk by chunk. `what` names the tensor in errors."""
    if nbytes == 0:
        return
    size_of = torch.empty((), dtype=source_dtype).element_size()
    target = dest if dest.is_contiguous() else torch.empty_like(dest, memory_format=torch.contiguous_format)
    flat = target.view(-1)
    if flat.dtype == source_dtype and flat.device.type == "cpu":
        _pread_into(fd, offset, flat.view(torch.uint8).numpy(), chunk_bytes, what)
    else:
        step = max(1, chunk_bytes // size_of) * size_of
        staging = bytearray(min(step, nbytes))
        view = memoryview(staging)
        done = 0
        while done < nbytes:
            size = min(step, nbytes - done)
            _pread_into(fd, offset + done, view[:size], chunk_bytes, what)
            part = torch.frombuffer(staging, dtype=source_dtype, count=size // size_of)
            flat[done // size_of : (done + size) // size_of].copy_(part)
            done += size
    if target is not dest:
        dest.copy_(target)


def _pread_into(fd: int, offset: int, buffer, chunk_bytes: int, what: str) -> None:
    """Fill `buffer` from the file at `offset` with preadv calls of at most chunk_bytes each."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done : done + chunk_bytes]], offset + done)
        if got == 0:
            raise CorruptWeightsError(
                f"{what}: the file ended at byte {offset + done:,}, inside the tensor; it was "
                f"truncated after its header was checked: save or copy it again"
            )
        done += got
