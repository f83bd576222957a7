"""Per-rank loading: a PipeFusion stage materialises only its own blocks of the transformer.

The model is built with empty (meta) parameters, the blocks of other stages are dropped, and
only the tensors this stage keeps are read from the safetensors files, with plain reads at the
byte ranges the header gives (shard_loading.load_weights: no file is mapped). `read_tensors`
reads named tensors through mmap, and with plain reads where mmap is refused ("Unable to mmap N
bytes").
"""

from __future__ import annotations

from pathlib import Path

import torch

from .families import FAMILIES
from .safetensors_io import SAFETENSORS_DTYPES, read_safetensors_header
from .shard_loading import load_weights, materialize


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

    def stage_name(key: str) -> str | None:  # a file key's name in this stage; None: another stage's block
        index = adapter.block_index(key, model.config)
        if index is None:
            return key
        if not start <= index < stop:
            return None
        block_list, position, rest = key.split(".", 2)
        return f"{renamed[f'{block_list}.{position}']}.{rest}"

    # plain reads of this stage's tensors only, never a mapping of the whole file (shard_loading.py)
    load_weights(materialize(model, "cpu", dtype=dtype), folder, dtype=dtype, rename=stage_name)
    model._xdit_lab_stage_blocks = (start, stop, total)
    return model.eval()
