"""Controls: deliberately wrong variants that a measured bound must catch.

A measured bound (the deviation of stale PipeFusion from the serial run, of a bfloat16 banded decode
from the float32 one, of int8 weights from the unquantized run) means something only if a wrong variant
exceeds it. These are those variants:

    parallelize(..., controls=wrong_stale_kv("zeros"))     zeros where the stale K/V should be
    load_pipeline(..., controls=wrong_stale_kv("read before write"))
                                                  a patch attends to its own K/V of the step before
    generate_with_control(config, n, kind)        (rank) the digits, optionally under one of them
    with band_statistics_in_activation_dtype(): ... the VAE band's GroupNorm sums in bfloat16 (the old bug)
    with cached_frames_without_halos(): ...       Wan's banded decode: no halo rows for its cached frames
    coarser_quantization(bits=4, group_size=32)   int4 weights: what a bound on int8 weight-only must catch
"""

from __future__ import annotations

import contextlib

import torch

from .. import comm, vae
from ..attention.stale import StaleKV
from ..models import Controls


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


def wrong_stale_kv(kind: str | None) -> Controls:
    """The Controls under which a model's PipeFusion stages build `kind`'s deliberately wrong buffers
    ("zeros" or "read before write") instead of StaleKV: a control that a bound on PipeFusion's
    deviation from serial must catch. None: no control (StaleKV). Given to one model (parallelize's or
    load_pipeline's `controls=`), it changes no other."""
    if kind is None:
        return Controls()
    if kind not in CONTROLS:
        raise ValueError(f"unknown control {kind!r}; choose one of {', '.join(CONTROLS)}")
    return Controls(buffer_type=CONTROLS[kind])


def generate_with_control(config, per_digit: int = 10, control: str | None = None) -> dict:
    """(rank) xdit_lab.digits.sample.generate_parallel(config, per_digit), its pipeline loaded with
    `control`'s wrong K/V buffers when one is named (see wrong_stale_kv)."""
    from ..digits.sample import generate_parallel

    return generate_parallel(config, per_digit, controls=wrong_stale_kv(control))


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


class ActivationDtypeStatisticsBands(vae.Bands):
    """CONTROL, deliberately wrong: the band's GroupNorm as it was before it summed in float32 (commit
    7bee749): the sums, the element count and the squares in the activations' dtype. In bfloat16 they
    round (a count of 8,448 is not a bfloat16 number), and the banded decode drifts from the whole one."""

    def group_norm(self, x, num_groups, weight=None, bias=None, eps=1e-5):
        grouped = x.reshape(x.shape[0], num_groups, -1)
        stats = torch.stack([grouped.sum(-1), torch.full_like(grouped[..., 0], grouped.shape[-1])])
        comm.all_reduce(stats, self.mesh, self.group, tag="vae_norm")
        mean = (stats[0] / stats[1]).unsqueeze(-1)
        squares = ((grouped - mean) ** 2).sum(-1)
        comm.all_reduce(squares, self.mesh, self.group, tag="vae_norm")
        out = ((grouped - mean) / torch.sqrt(squares / stats[1] + eps).unsqueeze(-1)).reshape(x.shape)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        if weight is not None:
            out = out * weight.reshape(shape)
        if bias is not None:
            out = out + bias.reshape(shape)
        return out


class CachedFramesWithoutHalosBands(vae.Bands):
    """CONTROL, deliberately wrong: Wan's causal convolutions get their halo rows for the frames of this
    call only, zeros for the frames their cache holds, as a banded decode that exchanged halos before
    the cache saw the input and cached the band alone would. Wan's 3×3×3 convolutions pad 2 frames in
    front, less one per cached frame (WanCausalConv3d): that tells which frames came from the cache."""

    def pad(self, x, pad, mode="constant", value=None):
        out = super().pad(x, pad, mode, value)
        if len(pad) == 6 and pad[2] and pad[4] < 2:
            cached = slice(pad[4], 2)  # after the zero frames in front: the cache's
            out[:, :, cached, : pad[2]] = 0
            out[:, :, cached, -pad[3] :] = 0
        return out


@contextlib.contextmanager
def cached_frames_without_halos():
    """Inside, every banded decode of this process pads as CachedFramesWithoutHalosBands: the control
    the exact Wan banded decode must beat. Restored on the way out."""
    before = vae.Bands
    vae.Bands = CachedFramesWithoutHalosBands
    try:
        yield
    finally:
        vae.Bands = before


@contextlib.contextmanager
def band_statistics_in_activation_dtype():
    """Inside, every banded VAE decode of this process normalises with ActivationDtypeStatisticsBands (its
    statistics summed in the activations' dtype): the control a bound on a bfloat16 banded decode must
    catch. Restored on the way out."""
    before = vae.Bands
    vae.Bands = ActivationDtypeStatisticsBands
    try:
        yield
    finally:
        vae.Bands = before
