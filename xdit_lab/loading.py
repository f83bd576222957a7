"""Per-rank loading: a PipeFusion stage materialises only its own blocks of the transformer.

The model is built with empty (meta) parameters, the blocks of other stages are dropped, and
only the tensors this stage keeps are read from the safetensors files (safe_open reads tensors
one by one). Where mmap is refused ("Unable to mmap N bytes"), the same tensors are read with
plain file reads at the byte ranges the header gives.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .memory import read_safetensors_header

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of one safetensors file, through mmap, or plain reads if mmap fails."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in keys}
    except (OSError, RuntimeError) as error:
        if "mmap" not in str(error).lower():
            raise
    header = read_safetensors_header(path)
    tensors = {}
    with open(path, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")  # after the length and the JSON header
        for key in keys:
            info = header[key]
            start, stop = info["data_offsets"]
            f.seek(data_start + start)
            raw = bytearray(f.read(stop - start))
            tensors[key] = torch.frombuffer(raw, dtype=SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def load_stage_transformer(folder: Path, class_name: str, stage_blocks: tuple[int, int], dtype: torch.dtype):
    """The diffusers transformer in `folder` with only blocks [start, stop) materialised."""
    import diffusers
    from accelerate import init_empty_weights

    cls = getattr(diffusers, class_name)
    with init_empty_weights():
        model = cls.from_config(cls.load_config(folder))
    total = len(model.transformer_blocks)
    start, stop = stage_blocks
    model.transformer_blocks = torch.nn.ModuleList(list(model.transformer_blocks)[start:stop])
    block_key = re.compile(r"^transformer_blocks\.(\d+)\.(.*)$")
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        wanted = {}
        for key in read_safetensors_header(file):
            match = block_key.match(key)
            if match is None:
                wanted[key] = key
            elif start <= int(match.group(1)) < stop:
                wanted[key] = f"transformer_blocks.{int(match.group(1)) - start}.{match.group(2)}"
        for key, tensor in read_tensors(file, list(wanted)).items():
            state[wanted[key]] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    still_empty = [name for name, p in model.named_parameters() if p.is_meta]
    if still_empty or unexpected:
        raise ValueError(
            f"{folder} does not match {class_name}: missing {still_empty[:5]}, unexpected {unexpected[:5]}"
        )
    model._xdit_lab_stage_blocks = (start, stop, total)
    return model.eval()
