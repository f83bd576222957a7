"""Controls: deliberately wrong variants that a measured bound must catch (stale PipeFusion's K/V buffers,
a quantization coarser than int8).

A measured bound (the deviation of stale PipeFusion, or of int8 weights, from the exact run) means something
only if a wrong variant exceeds it. These are those variants:

    with wrong_stale_kv("zeros"): ...            zeros where the stale K/V should be
    with wrong_stale_kv("read before write"): ... a patch attends to its own K/V of the step before
    generate_with_control(config, n, kind)        (rank) the digits, optionally under one of them
    coarser_quantization(bits=4, group_size=32)   int4 weights: what a bound on int8 weight-only must catch
"""

from __future__ import annotations

import contextlib

from ..attention.stale import StaleKV


class ZeroStaleKV(StaleKV):
    """CONTROL, deliberately wrong: where StaleKV hands attention the K/V a previous step left (every
    slice not written in this step), this hands it zeros. Its record says so: no step (None)."""

    def read(self, active, step):
        keys, values = super().read(active, step)
        fresh = [written == step for written in self.written_step]
        self.reads[-1] = (step, list(active), [w if f else None for w, f in zip(self.written_step, fresh)])
        keys, values = keys.clone(), values.clone()
        for (_, patch), (start, length) in self.offsets.items():
            if not fresh[patch]:
                keys[:, :, start : start + length] = 0
                values[:, :, start : start + length] = 0
        return keys, values


class ReadBeforeWriteKV(StaleKV):
    """CONTROL, deliberately wrong: attention reads the buffer before this call's fresh K/V go into
    it, so a patch attends to its own K/V from the step before (StaleKV writes first, then reads).
    Its record shows it: the patch's own slice read one step old."""

    pending = None  # (keys, values, active, step) of the write held back until after the read

    def write(self, keys, values, active, step):
        if self.keys is None:  # nothing to read yet: the first call writes at once
            return super().write(keys, values, active, step)
        self.pending = (keys, values, active, step)  # written after the read

    def read(self, active, step):
        keys, values = (t.clone() for t in super().read(active, step))
        if self.pending is not None:
            super().write(*self.pending)
            self.pending = None
        return keys, values


CONTROLS = {"zeros": ZeroStaleKV, "read before write": ReadBeforeWriteKV}


@contextlib.contextmanager
def wrong_stale_kv(kind: str):
    """Inside, every PipeFusion stage of this process builds `kind`'s deliberately wrong buffers
    ("zeros" or "read before write") instead of StaleKV: a control that a bound on PipeFusion's
    deviation from serial must catch. Restored on the way out."""
    from ..models import PipeFusionStage

    if kind not in CONTROLS:
        raise ValueError(f"unknown control {kind!r}; choose one of {', '.join(CONTROLS)}")
    before = PipeFusionStage.buffer_type
    PipeFusionStage.buffer_type = CONTROLS[kind]
    try:
        yield
    finally:
        PipeFusionStage.buffer_type = before


def generate_with_control(config, per_digit: int = 10, control: str | None = None) -> dict:
    """(rank) xdit_lab.digits.sample.generate_parallel(config, per_digit), with `control`'s wrong
    K/V buffers when one is named (see wrong_stale_kv)."""
    from ..digits.sample import generate_parallel

    with wrong_stale_kv(control) if control else contextlib.nullcontext():
        return generate_parallel(config, per_digit)


def coarser_quantization(bits: int = 4, group_size: int | None = 32):
    """CONTROL for a bound on int8 weight-only's deviation: the same components (the transformer and the text
    encoder) quantized coarser, to `bits` bits (torchao's IntxWeightOnlyConfig, a scale per `group_size`
    inputs, or per output row when None), as diffusers' PipelineQuantizationConfig. Not a scheme to use."""
    import torch
    import transformers
    from diffusers import PipelineQuantizationConfig, TorchAoConfig
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    granularity = PerAxis(0) if group_size is None else PerGroup(group_size)
    config = IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{bits}"), granularity=granularity)
    return PipelineQuantizationConfig(
        quant_mapping={"transformer": TorchAoConfig(config), "text_encoder": transformers.TorchAoConfig(config)}
    )
