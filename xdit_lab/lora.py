"""LoRA adapters fused into a pipeline's weights before the strategies parallelize it.

    pipe = load_pipeline(folder, ParallelConfig(ulysses=2), lora=[("path/to/style.safetensors", 0.8)])

diffusers' own loaders read each adapter (the pipeline's `load_lora_weights`, which converts the formats trainers
write and reads the rank and alpha a file keeps in its metadata) and peft injects it; `fuse_lora` then adds every
adapter to the weights at its scale, and the adapters are unloaded. What the strategies parallelize, compile or
split into stages is a plain transformer with changed weights:

    W  <-  W + Σ_i scale_i · (alpha_i / r_i) · B_i A_i          one linear layer, every adapter that targets it

Wan 2.2 A14B's two experts take an adapter each, as diffusers' WanPipeline does (`load_into_transformer_2=True`):
an entry (path, scale, "transformer_2") goes into the low-noise expert, (path, scale) into `transformer`.

Under PipeFusion a stage holds only its own blocks, renumbered (loading.keep_stage). An adapter's transformer keys
are renamed the same way and those of other stages' blocks left out, so each stage fuses exactly its share; the
stage's adapter goes through the transformer's own loader (`load_lora_adapter`) with the file's metadata.
"""

from __future__ import annotations

from pathlib import Path

TRANSFORMER_PREFIX = "transformer."


class LoraError(ValueError):
    """An adapter that cannot be fused here: the pipeline has no LoRA loader, a placement it cannot go with, or an
    argument of the wrong form (each said before loading by LoadOptions.problems); the message says what would
    work."""


def fuse_loras(pipe, adapters: list[tuple[object, float, str]], stage_names: dict | None = None) -> None:
    """Load every adapter into diffusers pipeline `pipe`, fuse them at their scales, unload them. `stage_names`:
    under PipeFusion, each transformer's renaming of its keys in this rank's stage (loading.stage_key_renaming),
    by component ("transformer", "transformer_2"); None for whole transformers."""
    if not adapters:
        return
    names, scales = [], []
    for i, (source, scale, into) in enumerate(adapters):
        name = f"xdit_lab_lora_{i}"
        if stage_names is None:
            expert = {"load_into_transformer_2": True} if into == "transformer_2" else {}
            pipe.load_lora_weights(source, adapter_name=name, **expert)
        elif not _load_stage_adapter(pipe, source, name, stage_names[into], into):
            continue  # none of this adapter's layers is in this stage's blocks
        names.append(name)
        scales.append(scale)
    if not names:
        return
    pipe.set_adapters(names, adapter_weights=scales)
    fused = [
        c for c in getattr(pipe, "_lora_loadable_modules", ["transformer"]) if _has_adapter(getattr(pipe, c, None))
    ]
    pipe.fuse_lora(components=fused, adapter_names=names, lora_scale=1.0)
    pipe.unload_lora_weights()  # the fused weights stay; peft's layers and the adapters' tensors go


def _has_adapter(module) -> bool:
    return module is not None and any(type(m).__module__.startswith("peft.") for m in module.modules())


def _load_stage_adapter(pipe, source, name: str, stage_name, into: str) -> bool:
    """One adapter into a PipeFusion stage's transformer `into`: its keys renamed as the stage's blocks are, other
    stages' blocks left out, with the rank and alpha from the file's metadata. False: nothing of it is here."""
    state, metadata = type(pipe).lora_state_dict(source, return_lora_metadata=True)
    others = sorted({key.split(".")[0] for key in state if not key.startswith(TRANSFORMER_PREFIX)})
    if others:
        raise LoraError(
            f"this LoRA also changes {', '.join(others)}: under PipeFusion only the transformer's adapter is fused "
            f"on each stage; use it without PipeFusion, or with its transformer part alone"
        )
    mine = {}
    for key, tensor in state.items():
        renamed = stage_name(key.removeprefix(TRANSFORMER_PREFIX))
        if renamed is not None:
            mine[TRANSFORMER_PREFIX + renamed] = tensor
    if mine:
        getattr(pipe, into).load_lora_adapter(mine, prefix="transformer", adapter_name=name, metadata=metadata)
    return bool(mine)


def lora_bytes(adapters: list[tuple[object, float, str]]) -> int:
    """What the adapters hold while they are fused: a state dict's tensors, a file's or a folder's files' bytes."""
    total = 0
    for source, *_ in adapters:
        if isinstance(source, dict):
            total += sum(t.numel() * t.element_size() for t in source.values())
        elif Path(source).is_dir():
            total += sum(f.stat().st_size for f in Path(source).glob("*.safetensors"))
        else:
            total += Path(source).stat().st_size
    return total
