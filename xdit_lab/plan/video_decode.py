"""The decode peak of Wan's causal 3D VAE (AutoencoderKLWan, Wan 2.1's and 2.2's), whole or in row bands, from
its configuration and the latent's (frames, rows, cols).

diffusers' decode runs the decoder once per latent frame, each causal convolution keeping the last two frames
of its input (its cache) for the next call, and concatenates each call's frames to the video so far. So the
bytes alive at any moment are

    held through the decode   the post-quant latent, every convolution's cache, the video decoded so far
    held through a call       the call's activations: a residual block's input, its shortcut, the RMS norm's
                              temporaries, the SiLU, the cached frames concatenated before the frames of
                              this call and F.pad's padded copy of them, the convolution's output
    at the end                the whole video and its clamped copy (and, patchified, its unpatchified
                              copy) beside the caches; in bands the gather of every band's video

Each call's frames: one latent frame, doubled by every temporal upsampling except in the first call (its
time convolution is skipped, "Rep"). The ledger below (Ledger) follows diffusers' decoder step by step,
allocating and freeing what each step does, and keeps the largest sum: a closed form in the sense that it
reads only the configuration and the latent's shape, checked against the tensors the decode really makes
(lab.measure.PeakTensorBytes, tests/test_vae.py) within 10%, whole and in bands.

At the real sizes (Wan 2.1's VAE, base 96, 720p × 81 frames: 21 latent frames of 90 × 160) the peak is a later
call's last up block, at full resolution with four frames of 96 channels: a residual block's first convolution,
its padded copy of the cached and new frames beside their concatenation, the block's input and the SiLU, on
top of every convolution's cache (two frames each, most of them at full resolution): 10.1 GB whole in
bfloat16, 1.35 GB per rank in 8 bands. The video itself (3 channels, 0.45 GB) is small beside it; on tiny
specimens (4 channels) the end's video and its clamped copy win past a few frames, which the tests cover too.
In bands every activation and cache shrinks with the band but the gathered video does not: the gather (the
band's video, a receive buffer per rank, the whole video) holds 0.95 GB at 8 bands, under a call's 1.35 GB.
"""

from __future__ import annotations

from ..sharding import shard_sizes

__all__ = ["Ledger", "gathered_video_bytes", "wan_decode_peak_bytes"]


class Ledger:
    """Bytes alive, and the most ever alive, as the decoder allocates and frees."""

    def __init__(self):
        self.live = self.peak = 0

    def new(self, size: int) -> int:
        self.live += size
        self.peak = max(self.peak, self.live)
        return size

    def free(self, *sizes: int) -> None:
        self.live -= sum(sizes)


def wan_decode_peak_bytes(vae_config: dict, latent_shape, element_bytes: int, *, bands: int = 1) -> int:
    """The most bytes one rank's AutoencoderKLWan decode holds at once (weights and the latent not counted), for
    a latent of `latent_shape` (batch, channels, frames, rows, cols) decoded whole or as the largest of `bands`
    row bands (xdit_lab/vae.py), `element_bytes` per activation (the RMS norm and the upsampling compute in
    float32 whatever the dtype)."""
    batch, _, frames, rows, cols = latent_shape
    band_rows = -(-rows // bands)
    wide = 4  # float32 temporaries of the RMS norm (half dtypes) and the upsampling's interpolation
    base = vae_config.get("decoder_base_dim") or vae_config.get("base_dim", 96)
    mult = list(vae_config.get("dim_mult", [1, 2, 4, 4]))
    residual = vae_config.get("is_residual", False)
    in_time = list(reversed(vae_config.get("temperal_downsample", [False, True, True])))
    z, blocks = vae_config.get("z_dim", 16), vae_config.get("num_res_blocks", 2)
    out_channels, patch = vae_config.get("out_channels", 3), vae_config.get("patch_size") or 1
    dims = [base * m for m in [mult[-1], *reversed(mult)]]
    ledger, caches = Ledger(), {}  # caches: each caching convolution's frames, by its place in the call

    def size(channels, t, scale, element=element_bytes, pad=0):  # a tensor of t frames at `scale`× the latent
        return batch * channels * t * (band_rows * scale + pad) * (cols * scale + pad) * element

    def halos(channels, t, scale):  # Bands.pad's two received rows (the sent ones are copies of one row each)
        return 4 * batch * channels * t * cols * scale * element_bytes if bands > 1 else 0

    def cache(slot, channels, t, scale):  # keep the last two frames of the input (one in the first call)
        kept = min(2, t)
        clone = ledger.new(size(channels, kept, scale))
        if kept < 2 and caches.get(slot):
            joined = ledger.new(size(channels, 2, scale))
            ledger.free(clone)
            clone = joined
        return clone

    def causal_conv(slot, c_in, c_out, t, scale):  # WanCausalConv3d, 3×3×3, its input alive in the caller
        new_cache = cache(slot, c_in, t, scale)
        old = caches.get(slot, 0)
        old_frames = 2 if old else 0
        joined = ledger.new(size(c_in, t + old_frames, scale)) if old else 0
        edge = ledger.new(halos(c_in, t + 2, scale))
        padded = ledger.new(size(c_in, t + 2, scale, pad=2))
        ledger.free(joined, edge)
        out = ledger.new(size(c_out, t, scale))
        ledger.free(padded, old)
        caches[slot] = new_cache
        return out

    def rms_norm(channels, t, scale):  # F.normalize, × scale × gamma + bias: the input stays with the caller
        x = size(channels, t, scale)
        upcast = element_bytes < 4
        f32 = ledger.new(size(channels, t, scale, wide)) if upcast else 0
        norm = ledger.new(2 * size(1, t, scale, wide if upcast else element_bytes))
        divided = ledger.new(size(channels, t, scale, wide if upcast else element_bytes))
        ledger.free(f32, norm)
        if upcast:
            cast = ledger.new(x)
            ledger.free(divided)
            divided = cast
        for _ in range(3):  # × scale, × gamma, + bias: each a new tensor, the one before freed
            step = ledger.new(x)
            ledger.free(divided)
            divided = step
        return divided

    def norm_act_conv(slot, c_in, c_out, t, scale):  # norm, SiLU, cached causal conv; returns the conv's output
        normed = rms_norm(c_in, t, scale)
        act = ledger.new(size(c_in, t, scale))
        ledger.free(normed)
        out = causal_conv(slot, c_in, c_out, t, scale)
        ledger.free(act)
        return out

    def resnet(slot, c_in, c_out, t, scale):  # input alive in the caller; returns the block's output
        shortcut = 0
        if c_in != c_out:  # a 1×1×1 causal conv: F.pad's copy (of zero padding), then the conv
            copy = ledger.new(size(c_in, t, scale))
            shortcut = ledger.new(size(c_out, t, scale))
            ledger.free(copy)
        first = norm_act_conv(slot, c_in, c_out, t, scale)
        normed = rms_norm(c_out, t, scale)
        ledger.free(first)
        act = ledger.new(size(c_out, t, scale))
        ledger.free(normed)
        second = causal_conv(slot + 1, c_out, c_out, t, scale)
        ledger.free(act)
        out = ledger.new(size(c_out, t, scale))
        ledger.free(second, shortcut)
        return out

    def attention(channels, scale):  # the mid block's, one frame (the latent's), one head
        normed = rms_norm(channels, 1, scale)
        qkv = ledger.new(size(3 * channels, 1, scale))
        contiguous = ledger.new(size(3 * channels, 1, scale))
        ledger.free(qkv)
        ring = ledger.new(size(8 * channels, 1, scale)) if bands > 1 else 0  # Ring's K/V blocks and partials
        out = ledger.new(size(channels, 1, scale))
        ledger.free(normed, ring)
        back = ledger.new(size(channels, 1, scale))
        ledger.free(out)
        projected = ledger.new(size(channels, 1, scale))
        ledger.free(back)
        summed = ledger.new(size(channels, 1, scale))
        ledger.free(projected, contiguous)
        return summed

    def upsample(slot, channels, c_out, t, scale, temporal, call):  # WanResample: input alive in the caller
        stacked = 0
        if temporal and call > 0:
            new_cache = cache(slot, channels, t, scale)
            old = caches.get(slot, 0)
            if old:
                joined = ledger.new(size(channels, t + 2, scale))
                padded = ledger.new(size(channels, t + 2, scale))
                ledger.free(joined)
            else:  # "Rep": the first frame's turn, no cache yet: two zero frames padded in front
                padded = ledger.new(size(channels, t + 2, scale))
            doubled = ledger.new(size(2 * channels, t, scale))
            ledger.free(padded, old)
            caches[slot] = new_cache
            stacked = ledger.new(size(2 * channels, t, scale))
            ledger.free(doubled)
            t *= 2
        frames = ledger.new(size(channels, t, scale)) if t > 1 else 0  # frames into the batch: a copy
        if frames:
            ledger.free(stacked)
            stacked = 0
        upcast = ledger.new(size(channels, t, scale, wide)) if element_bytes < 4 else 0
        up = ledger.new(size(channels, t, 2 * scale, wide))
        ledger.free(upcast)
        if element_bytes < 4:
            cast = ledger.new(size(channels, t, 2 * scale))
            ledger.free(up)
            up = cast
        edge = ledger.new(halos(channels, t, 2 * scale))  # Bands.conv2d: the halo rows, then the band with them
        with_halo = ledger.new(size(channels, t, 2 * scale) + edge // 2) if bands > 1 else 0
        ledger.free(edge)
        out = ledger.new(size(c_out, t, 2 * scale))
        ledger.free(with_halo, up, frames, stacked)
        return out, t

    video_frames = video = last = 0
    if bands > 1:  # the band's rows of the latent, made contiguous (vae.py)
        ledger.new(size(z, frames, 1))
    copy = ledger.new(size(z, frames, 1))  # post_quant_conv: F.pad's copy (of zero padding), then its output
    ledger.new(size(z, frames, 1))
    ledger.free(copy)
    for call in range(frames):
        t, scale, slot = 1, 1, 0
        x = causal_conv(slot, z, dims[0], t, scale)
        slot += 1
        # a block's input stays alive in the decoder's frame until the block returns (`x = block(x)`)
        held, x = x, resnet(slot, dims[0], dims[0], t, scale)
        slot += 2
        for step in ("attention", "resnet"):
            y = attention(dims[0], scale) if step == "attention" else resnet(slot, dims[0], dims[0], t, scale)
            slot += 2 * (step == "resnet")
            ledger.free(x)
            x = y
        ledger.free(held)
        for i in range(len(mult)):
            c_in, c_out = dims[i], dims[i + 1]
            if i > 0 and not residual:
                c_in //= 2
            up = i != len(mult) - 1
            temporal = up and in_time[i]
            copy = ledger.new(size(c_in, t, scale)) if residual else 0  # the residual block's x_copy
            held, x = x, resnet(slot, c_in, c_out, t, scale)
            slot += 2
            for _ in range(blocks):
                y = resnet(slot, c_out, c_out, t, scale)
                slot += 2
                ledger.free(x)
                x = y
            if up:
                y, t_up = upsample(slot, c_out, c_out if residual else c_out // 2, t, scale, temporal, call)
                slot += 1
                ledger.free(x)
                x = y
                if residual:  # DupUp3D: repeat_interleave, then its permuted contiguous copy, added
                    repeated = size(c_out * (2 if temporal else 1) * 4, t, scale)
                    ledger.new(repeated)
                    ledger.new(repeated)
                    ledger.free(repeated)
                    summed = ledger.new(size(c_out, t_up, 2 * scale))
                    ledger.free(repeated, x)
                    x = summed
                t, scale = t_up, 2 * scale
            ledger.free(copy, held)
        normed = rms_norm(dims[-1], t, scale)
        act = ledger.new(size(dims[-1], t, scale))
        ledger.free(normed)
        out = causal_conv(slot, dims[-1], out_channels, t, scale)
        ledger.free(act, x, last)  # the previous call's frames (`out_`) live until this call's are returned
        if call:  # torch.cat of the video so far and this call's frames
            joined = ledger.new(size(out_channels, video_frames + t, scale))
            ledger.free(video)
            video, last = joined, out
        else:
            video, last = out, 0  # the first call's frames are the video
        video_frames += t
    if patch > 1:  # unpatchify: a permuted copy
        unpatched = ledger.new(video)
        ledger.free(video)
        video = unpatched
    clamped = ledger.new(video)
    ledger.free(video, last, *caches.values())
    if bands > 1:
        ledger.new(gathered_video_bytes(clamped, band_rows, rows, bands) - clamped)
    return ledger.peak


def gathered_video_bytes(band_video: int, band_rows: int, rows: int, bands: int) -> int:
    """The bytes of the gather of every band's video (vae.py) on the rank whose band makes it largest, given the
    largest band's video of `band_video` bytes: its video, the band padded to the largest (a copy, when shorter), a
    receive buffer of the largest band per rank, then their concatenation."""
    per_row = band_video // band_rows  # video bytes per latent row
    padded = max(n + (n < band_rows) * band_rows + bands * band_rows for n in shard_sizes(rows, bands))
    return (padded + rows) * per_row
