"""Parallel VAE decode: each rank decodes only its images, and of those only its band of rows.

The dp and cfg ranks all hold the whole batch's latents after the last step: each decodes its
share of the images (split like the batch rows, dp-major), and the images are gathered after.

Decoding is a memory cliff: the decoder's activations grow with the image (64× the latent's
pixels, at 128 to 512 channels). The ranks that share an image (ring × ulysses, and PipeFusion's
stages) all hold the whole latents after the last step; instead of each decoding all of them,
rank i decodes rows [start_i, stop_i) of the latent (sharding.shard_range) and the bands are
gathered at the end:

    latent rows      0 1 2 3 | 4 5 6 7          band rank 0 | band rank 1
    each 3×3 conv    the row above and below the band come from the neighbours (a halo)
    each GroupNorm   mean and variance summed over the whole image (two all-reduces)
    mid attention    Ring attention over the bands (attention/ring.py; one head: no Ulysses)
    upsampling       nearest ×2 is local: the bands stay aligned, 8× taller at the end

diffusers' decoder runs unchanged: inside the decode, a TorchFunctionMode hands F.conv2d,
F.group_norm and F.scaled_dot_product_attention to the band-aware versions below. Every
collective is logged with a tag starting "vae". The result equals `vae.decode` of the whole
latent up to float rounding. Bands are on with ParallelConfig(vae_parallel=True), the default;
the split of images over dp × cfg always is. Under PipeFusion every stage holds the whole latents
too: the bands go over stages × sp (the mesh's "image" group). Flux.2's VAE is the same 2D decoder;
the 3D VAEs of the video families decode each rank's images whole.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import comm
from .attention.ring import ring_attention
from .mesh import CFG, DP, IMAGE, PIPEFUSION, SP
from .sharding import shard_range, shard_sizes

log = logging.getLogger("xdit_lab.vae")
BANDED_VAES = ("AutoencoderKL", "AutoencoderKLFlux2")  # 2D: diffusers' Decoder behind post_quant_conv
DECODED = "_xdit_lab_decoded"  # the VAE's attribute: what the last parallel decode did on this rank


def apply_parallel_vae(vae, mesh, *, bands: bool = True) -> bool:
    """Make `vae.decode` do only this rank's part: its images of the batch (split over the dp × cfg
    ranks, which hold the same latents after each step) and, with `bands` (ParallelConfig's
    vae_parallel), its band of rows over the ranks that share an image (band_group). False (nothing
    changed) when one rank holds every image and there are no bands to split. Bands need a 2D VAE
    (BANDED_VAES): the 3D VAEs of the video families decode their images whole (said in the log)."""
    sharing_images = mesh.group_size(DP) * mesh.group_size(CFG)
    if bands and mesh.group_size(IMAGE) > 1 and type(vae).__name__ not in BANDED_VAES:
        log.warning(
            "%s decodes this rank's images whole: row bands over the ranks of an image need a 2D VAE (%s)",
            type(vae).__name__,
            ", ".join(BANDED_VAES),
        )
        bands = False
    bands = bands and mesh.group_size(IMAGE) > 1
    if sharing_images == 1 and not bands:
        return False
    own_decode, module = type(vae).decode, weakref.ref(vae)  # held weakly: no cycle keeps a replaced VAE

    @functools.wraps(own_decode)
    def decode(z, return_dict=True, **kwargs):
        vae = module()
        image = _decode_my_part(vae, functools.partial(own_decode, vae), mesh, z, bands, **kwargs)
        if not return_dict:
            return (image,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=image)

    vae.decode = decode
    return True


@contextlib.contextmanager
def decoding_whole(vae):
    """Inside, `vae.decode` is diffusers' own again, for one rank decoding alone (a preview on rank
    0): the parallel decode's collectives would wait for peers that are not decoding."""
    parallel = vars(vae).pop("decode", None)
    try:
        yield vae
    finally:
        if parallel is not None:
            vae.decode = parallel


def band_group(mesh) -> str:
    """The ranks that share an image's bands: the sp group, or with PipeFusion every stage of it too
    (IMAGE: stage-major). Every one of them holds the whole latents after the last step."""
    return SP if mesh.group_size(PIPEFUSION) == 1 else IMAGE


def image_shares(batch: int, mesh) -> tuple[list[int], int]:
    """Images per dp × cfg rank (dp-major, as the batch rows are), and this rank's index."""
    dp, cfg = mesh.group_size(DP), mesh.group_size(CFG)
    return shard_sizes(batch, dp * cfg), mesh.group_rank(DP) * cfg + mesh.group_rank(CFG)


def _decode_my_part(vae, whole_decode, mesh, z, bands: bool, **kwargs):
    if getattr(vae, "use_tiling", False):
        raise ValueError("the parallel decode and diffusers' tiled decode do not combine: disable one")
    shares, me = image_shares(z.shape[0], mesh)
    start = sum(shares[:me])
    mine = z[start : start + shares[me]] if shares[me] else z[-1:]  # no image of its own: a stand-in, dropped
    group = band_group(mesh)
    rows, parts = z.shape[-2], mesh.group_size(group) if bands else 1
    sp_rank = mesh.group_rank(group) if bands else 0
    neighbours = (sp_rank > 0) + (sp_rank < parts - 1)
    setattr(
        vae,
        DECODED,
        dict(
            latent_shape=list(z.shape),
            image_shares=shares,
            images=shares[me],
            first_image=start,
            bands=[list(shard_range(rows, parts, i)) for i in range(parts)],
            band=list(shard_range(rows, parts, sp_rank)),
            halo_expected=halo_bytes(vae.config, tuple(mine.shape), z.element_size(), neighbours) if parts > 1 else 0,
        ),
    )
    if parts == 1:
        image = whole_decode(mine, return_dict=False, **kwargs)[0]
    else:
        if rows < parts:
            raise ValueError(f"{rows} latent rows cannot be split over {parts} ranks; decode with vae_parallel=False")
        first, last = shard_range(rows, parts, sp_rank)
        with Bands(mesh, total_rows=rows):
            band = whole_decode(mine[..., first:last, :].contiguous(), return_dict=False, **kwargs)[0]
        scale = band.shape[-2] // (last - first)  # output rows per latent row (8 for the usual VAE)
        sizes = [n * scale for n in shard_sizes(rows, parts)]
        image = comm.all_gather(band.contiguous(), mesh, group, dim=band.dim() - 2, sizes=sizes, tag="vae_gather")
    cfg, dp_rank = mesh.group_size(CFG), mesh.group_rank(DP)
    in_my_dp_group = shares[dp_rank * cfg : (dp_rank + 1) * cfg]
    image = comm.all_gather(image.contiguous(), mesh, CFG, dim=0, sizes=in_my_dp_group, tag="vae_gather")
    per_dp_group = [sum(shares[d * cfg : (d + 1) * cfg]) for d in range(mesh.group_size(DP))]
    return comm.all_gather(image, mesh, DP, dim=0, sizes=per_dp_group, tag="vae_gather")


class Bands(TorchFunctionMode):
    """Inside a band's decode: convolutions get halos, GroupNorm and attention see the whole image."""

    def __init__(self, mesh, total_rows: int):
        super().__init__()
        self.mesh, self.total_rows = mesh, total_rows
        self.group = band_group(mesh)
        self.me, self.parts = mesh.group_rank(self.group), mesh.group_size(self.group)
        ranks = mesh.group_ranks(self.group)
        self.above = ranks[self.me - 1] if self.me > 0 else None
        self.below = ranks[self.me + 1] if self.me + 1 < self.parts else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.conv2d:
            return self.conv2d(*args, **kwargs)
        if func is F.group_norm:
            return self.group_norm(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def conv2d(self, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if isinstance(padding, str) or stride not in (1, (1, 1)) or dilation not in (1, (1, 1)):
            raise NotImplementedError(
                f"patch-parallel decode handles stride-1 convolutions with numeric padding, got "
                f"stride {stride}, padding {padding}, dilation {dilation}"
            )
        pad_h, pad_w = (padding, padding) if isinstance(padding, int) else tuple(padding)
        if pad_h:  # the rows the kernel reaches beyond the band: the neighbours' (zeros at the image's edge)
            top, bottom = self._halos(x, pad_h)
            x = torch.cat([top, x, bottom], dim=2)
        return F.conv2d(x, weight, bias, 1, (0, pad_w), 1, groups)

    def _halos(self, x, rows: int):
        if x.shape[2] < rows:
            raise ValueError(f"a band of {x.shape[2]} rows cannot give a halo of {rows}; use fewer ranks")
        top = x.new_zeros((*x.shape[:2], rows, x.shape[3]))
        bottom = torch.zeros_like(top)
        sends, receives = [], []
        if self.above is not None:
            sends.append((x[:, :, :rows].contiguous(), self.above))
            receives.append((top, self.above))
        if self.below is not None:
            sends.append((x[:, :, -rows:].contiguous(), self.below))
            receives.append((bottom, self.below))
        comm.wait(comm.exchange(sends, receives, self.mesh, self.group, tag="vae_halo"))
        return top, bottom

    def group_norm(self, x, num_groups, weight=None, bias=None, eps=1e-5):
        """GroupNorm with the mean and variance of the whole image: sums all-reduced (two passes),
        in float32 whatever the activations' dtype (a bfloat16 sum or count would round)."""
        grouped = x.reshape(x.shape[0], num_groups, -1)
        count = grouped.new_full(grouped.shape[:2], grouped.shape[-1], dtype=torch.float32)
        stats = torch.stack([grouped.sum(-1, dtype=torch.float32), count])
        comm.all_reduce(stats, self.mesh, self.group, tag="vae_norm")
        centered = grouped.float() - (stats[0] / stats[1]).unsqueeze(-1)
        squares = centered.square().sum(-1)
        comm.all_reduce(squares, self.mesh, self.group, tag="vae_norm")
        out = centered.mul_(torch.rsqrt(squares / stats[1] + eps).unsqueeze(-1)).to(x.dtype).reshape(x.shape)
        del centered  # in place from here on: no second copy of the activations at the decode's peak
        shape = (1, -1) + (1,) * (x.dim() - 2)
        if weight is not None:
            out.mul_(weight.reshape(shape))
        if bias is not None:
            out.add_(bias.reshape(shape))
        return out

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        """The mid-block's attention over every band's tokens: Ring attention over the band ranks,
        each band one block (one head, so Ulysses cannot split it). K/V blocks travel; no rank
        holds the whole image's scores, which at a 128² latent are 1 GiB per image in float32."""
        if attn_mask is not None or dropout_p or is_causal:
            raise NotImplementedError("patch-parallel decode handles attention without mask, dropout or causality")
        band_rows = shard_sizes(self.total_rows, self.parts)
        per_row = key.shape[2] // band_rows[self.me]
        blocks = [rows * per_row for rows in band_rows]
        out, _ = ring_attention(query, key, value, self.mesh, blocks, scale=scale, group=self.group, tag_prefix="vae_")
        return out


def halo_bytes(vae_config, latent_shape, element_bytes: int, neighbours: int) -> int:
    """Bytes one rank sends in halos during one decode, from the decoder's configuration: every
    3×3 convolution sends one row of its input (channels × width at its resolution) to each of
    `neighbours` (1 at the image's top or bottom band, 2 in between)."""
    batch, channels, _, width = latent_shape
    top = vae_config["block_out_channels"][-1]
    convs = [(channels, width)] + [(top, width)] * 4  # conv_in, the mid block's two resnets
    previous, scale = top, 1
    blocks = list(reversed(vae_config["block_out_channels"]))
    for i, out in enumerate(blocks):
        for j in range(vae_config["layers_per_block"] + 1):
            convs += [(previous if j == 0 else out, width * scale), (out, width * scale)]
        if i < len(blocks) - 1:  # upsample ×2, then a 3×3 conv
            scale *= 2
            convs.append((out, width * scale))
        previous = out
    convs.append((vae_config["block_out_channels"][0], width * scale))  # conv_out
    return sum(batch * c * w for c, w in convs) * element_bytes * neighbours
