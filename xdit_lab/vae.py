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

Wan's causal 3D VAE (Wan 2.1 and 2.2, and Qwen-Image's, the same decoder) runs its decoder once per
latent frame, each causal convolution convolving the frames it cached from the calls before:

    latent frame t   the decoder runs on the band's rows of frame t (a call per frame, as diffusers does)
    3×3×3 conv       pads its own input (F.pad) and convolves unpadded: the rows F.pad adds are the
                     neighbours' instead, of every frame convolved, the cached ones too; each band's
                     cache holds its own rows, so the neighbour's cache holds the halo's (exact)
    RMS norm         over the channels of each pixel: local, nothing summed
    mid attention    per frame over the frame's pixels: Ring attention over the bands, as above
    upsampling       nearest ×2 and a 3×3 conv2d (a halo); the time convolution (3×1×1) is local

CogVideoX's 3D VAE runs its decoder on batches of two latent frames, its causal convolutions padding
frames themselves (the cache) and rows in F.conv3d: there the halo rows come from the neighbours as
for a 3×3 conv2d, cached frames included; its GroupNorms span the batch's frames and rows (statistics
summed over the bands, as above); its spatial norm's nearest resize of the latent band is local; no
attention. HunyuanVideo's runs its decoder on all frames at once (or on overlapping tiles of frames,
its framewise decoding), padding frames, rows and columns by replication in F.pad: the halo rows join
the band before it pads, and only the image's own edges replicate; GroupNorms as above; its mid
attention spans every frame, causal over frames: the K/V of every band are gathered (the mid block
is at the latent's resolution) and the band's frame-causal mask rebuilt over them.

LTX-2's runs its decoder on all frames at once (as HunyuanVideo-1.5's, below: RMS norm per pixel, upsampling
channels into frames and pixels, no attention), its convolutions padding their frames by repeating the first (and
last) and their rows by reflection inside nn.Conv3d (F.pad): the halo rows join the band before it reflects, and
only the image's own edges reflect; a decoder that injects noise (drawn at the band's size) decodes whole.

HunyuanVideo-1.5's runs its decoder on all frames at once (its tiling, off by default, is refused): its
causal convolutions pad by replication in F.pad, as HunyuanVideo's; its RMS norm is over each pixel's
channels (local); its mid attention is HunyuanVideo's frame-causal one; each upsampling convolves at
the lower resolution and then rearranges channels into 2 × 2 pixels (and into two frames, all but the
first), so latent row r becomes rows 2r and 2r + 1 of the band: local, the bands stay aligned.

diffusers' decoder runs unchanged: inside the decode, a TorchFunctionMode hands F.conv2d, F.pad,
F.conv3d, F.group_norm and F.scaled_dot_product_attention to the band-aware versions below. Every
collective is logged with a tag starting "vae", and each decode's halo bytes have a closed form
(halo_bytes, causal_halo_bytes, cogvideox_halo_bytes, hunyuan_halo_bytes, hunyuan15_halo_bytes). The
result equals `vae.decode` of the whole latent up to float rounding. Bands are on with
ParallelConfig(vae_parallel=True), the default; the split of images over dp × cfg always is. Under
PipeFusion every stage holds the whole latents too: the bands go over stages × sp (the mesh's
"image" group). Flux.2's VAE is the same 2D decoder; Sana's deep-compression VAE (AutoencoderDC,
its own blocks and linear attention) decodes each rank's images whole.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import comm
from .attention.ring import ring_attention
from .mesh import CFG, DP, IMAGE, PIPEFUSION, SP
from .sharding import shard_range, shard_sizes

log = logging.getLogger("xdit_lab.vae")
PLANAR_VAES = ("AutoencoderKL", "AutoencoderKLFlux2")  # 2D: diffusers' Decoder behind post_quant_conv
CAUSAL_VAES = ("AutoencoderKLWan", "AutoencoderKLQwenImage")  # Wan's causal 3D decoder, one latent frame a call
GROUPED_VIDEO_VAES = (
    "AutoencoderKLCogVideoX",
    "AutoencoderKLHunyuanVideo",
)  # GroupNorm over frames and rows, conv3d padding its rows
PACKED_VIDEO_VAES = ("AutoencoderKLHunyuanVideo15",)  # RMS norm per pixel, upsampling channels into pixels
REFLECTED_VIDEO_VAES = ("AutoencoderKLLTX2Video",)  # as those, its rows padded by reflection inside nn.Conv3d
BANDED_VAES = PLANAR_VAES + CAUSAL_VAES + GROUPED_VIDEO_VAES + PACKED_VIDEO_VAES + REFLECTED_VIDEO_VAES
DECODED = "_xdit_lab_decoded"  # the VAE's attribute: what the last parallel decode did on this rank


def apply_parallel_vae(vae, mesh, *, bands: bool = True) -> bool:
    """Make `vae.decode` do only this rank's part: its images of the batch (split over the dp × cfg
    ranks, which hold the same latents after each step) and, with `bands` (ParallelConfig's
    vae_parallel), its band of rows over the ranks that share an image (band_group). False (nothing
    changed) when one rank holds every image and there are no bands to split. Bands need a VAE of
    BANDED_VAES (the 2D ones, Wan's, CogVideoX's and both HunyuanVideos' 3D ones): the others (Sana's
    AutoencoderDC) decode their images whole (said in the log)."""
    sharing_images = mesh.group_size(DP) * mesh.group_size(CFG)
    noise = vae.config.get("decoder_inject_noise") or ()
    if bands and mesh.group_size(IMAGE) > 1 and (any(noise) if isinstance(noise, (list, tuple)) else noise):
        log.warning(  # LTX-2's noise is drawn per image of the band's size: a band's would not be the image's
            "%s injects noise in its decoder: it decodes this rank's images whole", type(vae).__name__
        )
        bands = False
    if bands and mesh.group_size(IMAGE) > 1 and type(vae).__name__ not in BANDED_VAES:
        log.warning(
            "%s decodes this rank's images whole: row bands over the ranks of an image need one of %s",
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
    kwargs = {  # an argument with one row per image (LTX-2's decode timestep) keeps this rank's rows
        key: (value[start : start + shares[me]] if shares[me] else value[-1:])
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == z.shape[0]
        else value
        for key, value in kwargs.items()
    }
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
            halo_expected=_halo_bytes(vae, tuple(mine.shape), z.element_size(), neighbours) if parts > 1 else 0,
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
        if func is F.pad:
            return self.pad(*args, **kwargs)
        if func is F.conv3d:
            return self.conv3d(*args, **kwargs)
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

    def pad(self, x, pad, mode="constant", value=None):
        """Wan's causal 3D convolution pads its input itself (F.pad: rows and columns by one, time causally,
        after its cached frames), then convolves unpadded: the rows it pads above and below the band are
        the neighbours' instead, of every frame it convolves, cached ones included. The cache holds this
        band's own rows of earlier frames, so the neighbours' caches hold the halo's: exchanging the halo
        of the input as the convolution sees it is exact without any halo in the cache.
        HunyuanVideo's pads by replication instead (frames, rows and columns): the halo rows join the
        band first and are replicated with it; only the image's own top and bottom rows replicate."""
        if len(pad) < 4 or not (pad[2] or pad[3]):
            return F.pad(x, pad, mode=mode, value=value)
        if mode not in ("constant", "replicate", "reflect") or value or pad[2] != pad[3]:
            raise NotImplementedError(
                f"patch-parallel decode pads rows with zeros or by replication, as many above as below, got "
                f"{pad} ({mode}, {value})"
            )
        rows = pad[2]
        top, bottom = self._halos(x, rows)
        if mode in ("replicate", "reflect"):
            inner = [top] * (self.above is not None) + [x] + [bottom] * (self.below is not None)
            at_edges = [rows * (self.above is None), rows * (self.below is None)]
            return F.pad(torch.cat(inner, dim=-2), [*pad[:2], *at_edges, *pad[4:]], mode=mode)
        padded = F.pad(x, pad)  # the one tensor diffusers' own pad makes; its zero rows take the halos
        # x's place in it, last dim first; the halos sit beside x's frames and columns (zeros beside them too)
        place = [slice(pad[2 * d], pad[2 * d] + x.shape[-1 - d]) for d in range(len(pad) // 2)]
        place[1] = slice(0, rows)
        padded[(..., *reversed(place))] = top
        place[1] = slice(padded.shape[-2] - rows, padded.shape[-2])
        padded[(..., *reversed(place))] = bottom
        return padded

    def conv3d(self, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        """Wan's causal convolution pads its rows itself (pad above) and calls this with none; CogVideoX's
        pads its frames itself (its cache, or the first frame repeated) and its rows here: as conv2d's,
        the neighbours' rows of every frame convolved. Each band caches its own rows, so the neighbours'
        caches hold the halo's, as in pad."""

        def triple(v):
            return (v,) * 3 if isinstance(v, int) else tuple(v)

        if isinstance(padding, str) or triple(stride)[1] != 1 or triple(dilation)[1] != 1:
            raise NotImplementedError(
                f"patch-parallel decode handles 3D convolutions of row stride and dilation 1 with numeric padding, "
                f"got stride {stride}, padding {padding}, dilation {dilation}"
            )
        pad_t, pad_h, pad_w = triple(padding)
        if pad_h:
            top, bottom = self._halos(x, pad_h)
            x = torch.cat([top, x, bottom], dim=-2)
        return F.conv3d(x, weight, bias, stride, (pad_t, 0, pad_w), dilation, groups)

    def _halos(self, x, rows: int):
        """The `rows` rows (x's dim -2) of the neighbours above and below the band: zeros at the image's edge."""
        if x.shape[-2] < rows:
            raise ValueError(f"a band of {x.shape[-2]} rows cannot give a halo of {rows}; use fewer ranks")
        top = x.new_zeros((*x.shape[:-2], rows, x.shape[-1]))
        bottom = torch.zeros_like(top)
        sends, receives = [], []
        if self.above is not None:
            sends.append((x[..., :rows, :].contiguous(), self.above))
            receives.append((top, self.above))
        if self.below is not None:
            sends.append((x[..., -rows:, :].contiguous(), self.below))
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
        if dropout_p or is_causal:
            raise NotImplementedError("patch-parallel decode handles attention without dropout or causality")
        if attn_mask is not None:
            return self.frame_causal_attention(query, key, value, attn_mask, scale)
        band_rows = shard_sizes(self.total_rows, self.parts)
        per_row = key.shape[2] // band_rows[self.me]
        blocks = [rows * per_row for rows in band_rows]
        out, _ = ring_attention(query, key, value, self.mesh, blocks, scale=scale, group=self.group, tag_prefix="vae_")
        return out

    def frame_causal_attention(self, query, key, value, attn_mask, scale):
        """HunyuanVideo's mid-block attention (HunyuanVideo-1.5's is the same): over every frame's pixels,
        tokens frame-major, a frame's queries attending the keys of its own and earlier frames (its mask).
        The mask diffusers made is the band's own; the keys of every band are gathered (the mid block's
        latent resolution is small) and the mask rebuilt over them, after checking the band's is that
        frame-causal mask (two host syncs, once per decoder call)."""
        band_rows = shard_sizes(self.total_rows, self.parts)
        local = attn_mask.reshape(-1, *attn_mask.shape[-2:])[0]
        per_frame = int((local[0] == 0).sum())  # the tokens of frame 0: what the first query attends
        frames, per_row = key.shape[2] // per_frame, per_frame // band_rows[self.me]

        def frame_of(rows):  # the frame of each token of a band of `rows` rows, frame-major
            return torch.arange(frames, device=key.device).repeat_interleave(rows * per_row)

        def causal(query_frames, key_frames):
            return torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
                key_frames[None, :] > query_frames[:, None], float("-inf")
            )

        mine = frame_of(band_rows[self.me])
        if per_frame * frames != key.shape[2] or not torch.equal(local, causal(mine, mine)):
            raise NotImplementedError("patch-parallel decode handles attention masks causal over frames only")
        sizes = [frames * rows * per_row for rows in band_rows]
        both = comm.all_gather(torch.stack([key, value]), self.mesh, self.group, dim=3, sizes=sizes, tag="vae_kv")
        every = torch.cat([frame_of(rows) for rows in band_rows])
        return F.scaled_dot_product_attention(query, both[0], both[1], attn_mask=causal(mine, every), scale=scale)


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


def _halo_bytes(vae, latent_shape, element_bytes: int, neighbours: int) -> int:
    kind = type(vae).__name__
    if kind in CAUSAL_VAES:
        return causal_halo_bytes(vae.config, latent_shape, element_bytes, neighbours)
    if kind == "AutoencoderKLCogVideoX":
        return cogvideox_halo_bytes(vae.config, latent_shape, element_bytes, neighbours)
    if kind == "AutoencoderKLHunyuanVideo":
        calls = hunyuan_decoder_frames(vae, latent_shape[2])
        return hunyuan_halo_bytes(vae.config, latent_shape, element_bytes, neighbours, calls)
    if kind in PACKED_VIDEO_VAES:
        return hunyuan15_halo_bytes(vae.config, latent_shape, element_bytes, neighbours)
    if kind in REFLECTED_VIDEO_VAES:
        return ltx2_halo_bytes(vae.config, latent_shape, element_bytes, neighbours)
    return halo_bytes(vae.config, latent_shape, element_bytes, neighbours)


def causal_halo_bytes(vae_config, latent_shape, element_bytes: int, neighbours: int) -> int:
    """Bytes one rank sends in halos during one decode of Wan's causal 3D VAE (AutoencoderKLWan's config
    keys; Qwen-Image's VAE is the same decoder). The decoder runs once per latent frame; every 3×3×3
    convolution sends one row of its input to each neighbour, of the frames it convolves: this call's,
    after the frames its cache holds (the last two it saw, fewer at first). Each upsampling's 3×3 conv2d
    sends one row of every frame at twice the width. A temporal upsampling doubles the frames of every
    call after the first; its time convolution (3×1×1) pads no rows."""
    batch, _, latent_frames, _, width = latent_shape
    base = vae_config.get("decoder_base_dim") or vae_config["base_dim"]
    mult, residual = vae_config["dim_mult"], vae_config.get("is_residual", False)
    in_time = list(reversed(vae_config["temperal_downsample"]))
    dims = [base * m for m in [mult[-1], *reversed(mult)]]
    # (input channels, width, upsamplings in time before it) of every 3×3×3 convolution, and of every conv2d
    convs3d = [(vae_config["z_dim"], width, 0)] + [(dims[0], width, 0)] * 4  # conv_in, the mid block's resnets
    convs2d, scale, doublings = [], 1, 0
    for i, (channels, out) in enumerate(zip(dims[:-1], dims[1:])):
        channels = channels // 2 if i > 0 and not residual else channels  # Wan 2.1's upsampling halves them
        for _ in range(vae_config["num_res_blocks"] + 1):
            convs3d += [(channels, width * scale, doublings), (out, width * scale, doublings)]
            channels = out
        if i < len(mult) - 1:  # nearest ×2, then a 3×3 conv2d (after the time convolution of a 3D one)
            doublings += bool(in_time[i])
            scale *= 2
            convs2d.append((out, width * scale, doublings))
    convs3d.append((dims[-1], width * scale, doublings))  # conv_out

    def frames(call, doubled):  # the first call's frame is never doubled ("Rep": the time conv is skipped)
        return 1 if call == 0 else 2**doubled

    sent = 0
    for call in range(latent_frames):
        for channels, cols, doubled in convs3d:
            cached = min(2, sum(frames(earlier, doubled) for earlier in range(call)))
            sent += channels * cols * (cached + frames(call, doubled))
        sent += sum(channels * cols * frames(call, doubled) for channels, cols, doubled in convs2d)
    return sent * batch * element_bytes * neighbours


def cogvideox_halo_bytes(vae_config, latent_shape, element_bytes: int, neighbours: int) -> int:
    """Bytes one rank sends in halos during one decode of CogVideoX's VAE. The decoder runs on batches of
    two latent frames (the first batch takes the odd one too); every 3×3×3 convolution sends one row of
    its input to each neighbour, of the batch's frames after the two its cache holds (the first frame
    twice in the first batch). Each upsampling's 3×3 conv2d sends one row of every frame at twice the
    width; one that compresses time doubles the frames (all but the first when they are odd). Below
    CogVideoXSafeConv3d's 2 GiB, where it splits a convolution's frames (more halo rows)."""
    batch, _, latent_frames, _, width = latent_shape
    channels = list(reversed(vae_config["block_out_channels"]))
    in_time = round(math.log2(vae_config["temporal_compression_ratio"]))
    rest = latent_frames % 2
    frame_batches = [min(latent_frames, 2 + rest)] + [2] * (max(latent_frames // 2, 1) - 1)

    def sent(frames):  # one batch of the decoder's: the channels × width × frames of each convolution's halo row
        total = (vae_config["latent_channels"] + 4 * channels[0]) * width * (frames + 2)  # conv_in, the mid block
        previous, cols = channels[0], width
        for i, out in enumerate(channels):
            for j in range(vae_config["layers_per_block"] + 1):
                total += ((previous if j == 0 else out) + out) * cols * (frames + 2)
            previous = out
            if i < len(channels) - 1:  # nearest ×2 (in time too while compressing it), then a 3×3 conv2d
                if i < in_time:
                    frames = 2 * frames - frames % 2
                cols *= 2
                total += out * cols * frames
        return total + channels[-1] * cols * (frames + 2)  # conv_out

    return sum(sent(frames) for frames in frame_batches) * batch * element_bytes * neighbours


def hunyuan_decoder_frames(vae, latent_frames: int) -> list[int]:
    """The latent frames of each call of HunyuanVideo's decoder: all at once, or with its framewise
    decoding (on by default) past tile_sample_min_num_frames, overlapping tiles of frames."""
    ratio = vae.temporal_compression_ratio
    tile, stride = vae.tile_sample_min_num_frames // ratio, vae.tile_sample_stride_num_frames // ratio
    if not (vae.use_framewise_decoding and latent_frames > tile):
        return [latent_frames]
    return [min(latent_frames, start + tile + 1) - start for start in range(0, latent_frames, stride)]


def hunyuan_halo_bytes(vae_config, latent_shape, element_bytes: int, neighbours: int, calls: list[int]) -> int:
    """Bytes one rank sends in halos during one decode of HunyuanVideo's VAE, its decoder called on
    `calls` latent frames each (hunyuan_decoder_frames). Its convolutions pad by replication after the
    halo joins the band: every 3×3×3 one sends one row of each of its input's frames to each neighbour.
    An upsampling (nearest, in time all frames but the first) is followed by such a convolution."""
    batch, _, _, _, width = latent_shape
    channels = list(reversed(vae_config["block_out_channels"]))
    in_space = round(math.log2(vae_config["spatial_compression_ratio"]))
    in_time = round(math.log2(vae_config["temporal_compression_ratio"]))

    def sent(frames):  # one call of the decoder's
        total = (vae_config["latent_channels"] + 4 * channels[0]) * width * frames  # conv_in, the mid block
        previous, cols = channels[0], width
        for i, out in enumerate(channels):
            for j in range(vae_config["layers_per_block"] + 1):
                total += ((previous if j == 0 else out) + out) * cols * frames
            previous = out
            spatial, temporal = i < in_space, len(channels) - 1 - in_time <= i < len(channels) - 1
            if spatial or temporal:
                cols *= 2 if spatial else 1
                frames = 2 * frames - 1 if temporal else frames
                total += out * cols * frames
        return total + channels[-1] * cols * frames  # conv_out

    return sum(sent(frames) for frames in calls) * batch * element_bytes * neighbours


def hunyuan15_halo_bytes(vae_config, latent_shape, element_bytes: int, neighbours: int) -> int:
    """Bytes one rank sends in halos during one decode of HunyuanVideo-1.5's VAE, its decoder called once on
    every frame. Its convolutions pad by replication after the halo joins the band: every 3×3×3 one sends one
    row of each of its input's frames to each neighbour. An upsampling convolves before it rearranges channels
    into pixels (at the lower resolution), then doubles the columns, and in time all frames but the first."""
    batch, _, frames, _, width = latent_shape
    channels = list(reversed(vae_config["block_out_channels"]))
    in_space = round(math.log2(vae_config["spatial_compression_ratio"]))
    in_time = round(math.log2(vae_config["temporal_compression_ratio"]))
    total = (vae_config["latent_channels"] + 4 * channels[0]) * width * frames  # conv_in, the mid block's resnets
    previous, cols = channels[0], width
    for i, out in enumerate(channels):
        for j in range(vae_config["layers_per_block"] + 1):
            total += ((previous if j == 0 else out) + out) * cols * frames
        previous = out
        if i < in_space or i < in_time:  # the upsampling's convolution, then 2 × 2 pixels (and 2 frames) a channel
            total += out * cols * frames
            cols, frames = 2 * cols, 2 * frames - 1 if i < in_time else frames
            previous = channels[i + 1] if vae_config["upsample_match_channel"] else out
    total += channels[-1] * cols * frames  # conv_out
    return total * batch * element_bytes * neighbours


def ltx2_halo_bytes(vae_config, latent_shape, element_bytes: int, neighbours: int) -> int:
    """Bytes one rank sends in halos during one decode of LTX-2's video VAE, its decoder called once on every
    frame. Each 3×3×3 convolution pads its frames itself (the first, or the first and last, repeated: two frames
    more) and then its rows by reflection after the halo joins the band: one row of each of its input's padded
    frames to each neighbour. Each up block's upsampling convolves before it rearranges channels into frames and
    pixels (all but the first frame doubled, in time); 1×1×1 shortcuts pad nothing."""
    batch, _, frames, _, cols = latent_shape
    c = vae_config
    blocks = len(c["decoder_layers_per_block"])
    layers = list(reversed(c["decoder_layers_per_block"]))
    widths = list(reversed(c["decoder_block_out_channels"]))
    scaling = c["decoder_spatio_temporal_scaling"]
    scaling = list(reversed(scaling if isinstance(scaling, list) else [scaling] * (blocks - 1)))
    factors = list(reversed(c["upsample_factor"]))
    strides = dict(spatial=(1, 2), temporal=(2, 1), spatiotemporal=(2, 2))

    def conv(channels):  # one 3×3×3 convolution's halo rows, per neighbour, at the running size
        return channels * (frames + 2) * cols

    out = widths[0]
    total = conv(c["latent_channels"]) + layers[0] * 2 * conv(out)  # conv_in, the mid block's resnets
    for i, width in enumerate(widths):
        first, out = out // factors[i], width // factors[i]
        if first != out:  # the block's first resnet changes the channels
            total += conv(first) + conv(out)
        if scaling[i]:
            total += conv(out * factors[i])
            time, space = strides[c["upsample_type"][i]]
            frames, cols = frames * time - (time - 1), cols * space
        total += layers[i + 1] * 2 * conv(out)
    total += conv(out)  # conv_out
    return total * batch * element_bytes * neighbours
