"""Per-rank loading: a PipeFusion stage materialises only its own blocks of the transformer.

The model is built with empty (meta) parameters, the blocks of other stages are dropped, and
only the tensors this stage keeps are read from the safetensors files (safe_open reads tensors
one by one). Where mmap is refused ("Unable to mmap N bytes"), the same tensors are read with
plain file reads at the byte ranges the header gives.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .families import FAMILIES
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
    """The diffusers transformer in `folder` with only its stacked blocks [start, stop) materialised
    (Flux's stack: its double-stream blocks, then its single-stream ones)."""
    import diffusers
    from accelerate import init_empty_weights

    cls = getattr(diffusers, class_name)
    adapter = FAMILIES[class_name]
    with init_empty_weights():
        model = cls.from_config(cls.load_config(folder))
    total = adapter.num_blocks(model.config)
    start, stop = stage_blocks
    # a kept block's name in the model -> its name in this stage
    renamed = {whole: mine for mine, whole in adapter.stage_block_names(model.config, start, stop).items()}
    adapter.keep_blocks(model, start, stop)
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        wanted = {}
        for key in read_safetensors_header(file):
            index = adapter.block_index(key, model.config)
            if index is None:
                wanted[key] = key
            elif start <= index < stop:
                block_list, position, rest = key.split(".", 2)
                wanted[key] = f"{renamed[f'{block_list}.{position}']}.{rest}"
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
