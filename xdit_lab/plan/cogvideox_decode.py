"""The decode peak of CogVideoX's causal 3D VAE (AutoencoderKLCogVideoX), whole or in row bands, from its
configuration and the latent's shape.

diffusers' decode runs the decoder on batches of two latent frames (the first takes an odd one too), each causal
convolution joining the two frames it cached from the batch before (the first frame twice, in the first batch)
to this batch's, and keeping a clone of its input's last two frames for the next. The caches of the batch before
live until the decoder returns (`_decode` rebinds them then), so during a batch both sets do. Every norm is a
spatial norm: GroupNorm of the activations, times and plus two 1×1×1 convolutions of the latent batch resized to
their resolution, each of which caches a clone of its whole input (its kernel's `-1 + 1` frames: all of them).

    held through the decode   every batch's video so far (joined at the end)
    held through a batch      the post-quant latent batch, both batches' caches
    held through a block      its input (the decoder's loop), the up block's resnet outputs in turn
    a resnet                  spatial norm (resized latent, two convolutions and their caches, the GroupNorm, the
                              product and the sum), SiLU, causal conv (its frames joined to the cache, the new
                              cache, the output), again, then the shortcut and the sum
    an upsampling             nearest ×2 (in time too while it compresses time: all but the first frame of an odd
                              count), frames into the batch (a copy), a 3×3 conv2d
    CogVideoXSafeConv3d       an input over 2 GiB (counted at 2 bytes an element) is convolved in chunks of frames:
                              the chunks after the first joined to their two frames before (copies), every chunk's
                              output, then their concatenation

In bands (vae.py) every activation and cache is the band's, each 3×3 convolution also holds the halo rows and the
band joined with them, the GroupNorm a float32 centred copy and its square (vae.Bands.group_norm), and the end the
gather of the bands' videos. There is no attention. At CogVideoX-5b's 480 × 720 × 49 frames (13 latent frames of
60 × 90: batches of 3, then 2) the peak, 15.8 GB in bfloat16, is inside a resnet's spatial norm, beside both
batches' caches. Checked against the tensors the decode really makes (lab.measure.PeakTensorBytes,
tests/test_vae.py) within 10%, whole and in bands, float32 and bfloat16.
"""

from __future__ import annotations

import math

from .video_decode import Ledger, gathered_video_bytes

__all__ = ["cogvideox_decode_peak_bytes"]


def cogvideox_decode_peak_bytes(vae_config: dict, latent_shape, element_bytes: int, *, bands: int = 1) -> int:
    """The most bytes one rank's AutoencoderKLCogVideoX decode holds at once (weights and the latent not counted),
    for a latent of `latent_shape` (batch, channels, frames, rows, cols) decoded whole or as the largest of `bands`
    row bands (xdit_lab/vae.py), `element_bytes` per activation (vae.Bands' GroupNorm computes in float32)."""
    batch, _, frames, rows, cols = latent_shape
    band_rows = -(-rows // bands)
    z = vae_config.get("latent_channels", 16)
    channels = list(reversed(vae_config.get("block_out_channels", (128, 256, 256, 512))))
    blocks = vae_config.get("layers_per_block", 3) + 1
    in_time = round(math.log2(vae_config.get("temporal_compression_ratio", 4)))
    out_channels, e, wide = vae_config.get("out_channels", 3), element_bytes, 4
    ledger = Ledger()
    old, new = {}, {}  # each caching convolution's clone, by its place in the batch: the batch before's, this one's

    def size(c, t, scale, element=e, pad=0):  # a tensor of t frames at `scale`× the latent
        return batch * c * t * (band_rows * scale + pad) * cols * scale * element

    def halo(c, t, scale):  # vae.Bands._halos: two received rows, the sent copies (two at most)
        return 4 * batch * c * t * cols * scale * e if bands > 1 else 0

    def conv3d(c_in, c_out, t, scale):  # a 3×3×3 CogVideoXSafeConv3d on t + 2 frames (input alive in the caller)
        gib = batch * c_in * (t + 2) * band_rows * scale * cols * scale * 2 / 1024**3
        parts = int(gib / 2) + 1 if gib > 2 else 1
        chunk = -(-(t + 2) // parts)
        lengths = [min(chunk, t + 2 - i * chunk) for i in range(parts) if i * chunk < t + 2]
        joined = [ledger.new(size(c_in, n + 2, scale)) for n in lengths[1:]]  # chunks after the first
        outputs = []
        for i, n in enumerate(lengths):
            n_in = n + 2 * (i > 0)
            edge = ledger.new(halo(c_in, n_in, scale))
            with_halo = ledger.new(size(c_in, n_in, scale) + edge // 2) if bands > 1 else 0
            outputs.append(ledger.new(size(c_out, n_in - 2, scale)))
            ledger.free(edge, with_halo)
        if parts == 1:
            return outputs[0]
        out = ledger.new(size(c_out, t, scale))
        ledger.free(*joined, *outputs)
        return out

    def causal_conv(slot, c_in, c_out, t, scale):  # the cache (or the first frame twice) joined before the frames
        joined = ledger.new(size(c_in, t + 2, scale))
        new[slot] = ledger.new(size(c_in, 2, scale))
        out = conv3d(c_in, c_out, t, scale)
        ledger.free(joined)
        return out

    def group_norm(c, t, scale):  # the input stays with the caller
        if bands == 1:
            return ledger.new(size(c, t, scale))
        upcast = ledger.new(size(c, t, scale, wide)) if e < 4 else 0  # grouped.float()
        centred = ledger.new(size(c, t, scale, wide))
        ledger.free(upcast)
        square = ledger.new(size(c, t, scale, wide))
        ledger.free(square)
        if e < 4:
            out = ledger.new(size(c, t, scale))
            ledger.free(centred)
            return out
        return centred

    def spatial_norm(slot, c, t, scale):  # CogVideoXSpatialNorm3D: the latent batch resized, two convs, GroupNorm
        if t > 1 and t % 2:
            parts = ledger.new(size(z, t, scale))  # the first frame and the rest resized apart, then joined
            zq = ledger.new(size(z, t, scale))
        else:
            parts, zq = 0, ledger.new(size(z, t, scale))
        new[slot] = ledger.new(size(z, t, scale))  # conv_y's cache: a clone of all of zq
        conv_y = ledger.new(size(c, t, scale))
        new[slot + 1] = ledger.new(size(z, t, scale))
        conv_b = ledger.new(size(c, t, scale))
        normed = group_norm(c, t, scale)
        product = ledger.new(size(c, t, scale))
        out = ledger.new(size(c, t, scale))
        ledger.free(product, normed, conv_y, conv_b, zq, parts)
        return out

    def resnet(slot, c_in, c_out, t, scale):  # input alive in the caller
        normed = spatial_norm(slot, c_in, t, scale)
        act = ledger.new(size(c_in, t, scale))
        ledger.free(normed)
        h = causal_conv(slot + 2, c_in, c_out, t, scale)
        ledger.free(act)
        normed = spatial_norm(slot + 3, c_out, t, scale)
        ledger.free(h)
        act = ledger.new(size(c_out, t, scale))
        ledger.free(normed)
        h = causal_conv(slot + 5, c_out, c_out, t, scale)
        ledger.free(act)
        shortcut = ledger.new(size(c_out, t, scale)) if c_in != c_out else 0  # a 1×1×1 conv
        out = ledger.new(size(c_out, t, scale))
        ledger.free(h, shortcut)
        return out

    def upsample(c, t, scale, compress):  # input alive in the caller; returns (output, frames)
        first = 0
        if compress and t > 1 and t % 2:
            first = ledger.new(size(c, 1, 2 * scale))
            rest = ledger.new(size(c, 2 * (t - 1), 2 * scale))
            t_up = 2 * t - 1
            up = ledger.new(size(c, t_up, 2 * scale))
            batched = ledger.new(size(c, t_up, 2 * scale))  # permute(...).reshape: a copy
        elif compress:
            t_up = 2 * t if t > 1 else 1
            rest, up = 0, ledger.new(size(c, t_up, 2 * scale))
            batched = ledger.new(size(c, t_up, 2 * scale)) if t_up > 1 else 0  # one frame: a view
        else:  # frames into the batch first (a copy), then resized: already in the batch's order
            t_up, rest = t, 0
            copy = ledger.new(size(c, t, scale))
            up = ledger.new(size(c, t, 2 * scale))
            ledger.free(copy)
            batched = 0
        edge = ledger.new(halo(c, t_up, 2 * scale))
        with_halo = ledger.new(size(c, t_up, 2 * scale) + edge // 2) if bands > 1 else 0
        ledger.free(edge)
        out = ledger.new(size(c, t_up, 2 * scale))
        ledger.free(with_halo, batched, up, rest, first)
        return out, t_up

    rest = frames % 2
    frame_batches = [min(frames, 2 + rest)] + [2] * (max(frames // 2, 1) - 1)
    if bands > 1:
        ledger.new(size(z, frames, 1))  # the band's rows of the latent, made contiguous (vae.py)
    videos = []
    for t in frame_batches:
        scale, slot = 1, 0
        quant = ledger.new(size(z, t, 1))  # post_quant_conv of the batch: the decoder's `sample`
        x = causal_conv(slot, z, channels[0], t, scale)
        slot += 1
        held = x  # the decoder holds the mid block's input until it returns
        for k in range(2):
            y = resnet(slot, channels[0], channels[0], t, scale)
            slot += 7
            if k:
                ledger.free(x)
            x = y
        ledger.free(held)
        previous = channels[0]
        for i, out in enumerate(channels):
            held = x  # the decoder holds an up block's input until it returns
            for j in range(blocks):
                y = resnet(slot, previous if j == 0 else out, out, t, scale)
                slot += 7
                if j:
                    ledger.free(x)
                x = y
            previous = out
            if i < len(channels) - 1:
                y, t = upsample(out, t, scale, i < in_time)
                scale *= 2
                ledger.free(x)
                x = y
            ledger.free(held)
        normed = spatial_norm(slot, channels[-1], t, scale)
        act = ledger.new(size(channels[-1], t, scale))
        ledger.free(normed)
        video = causal_conv(slot + 2, channels[-1], out_channels, t, scale)
        ledger.free(act, x, quant, *old.values())
        old, new = new, {}
        videos.append(video)
    if len(videos) > 1:
        video = ledger.new(sum(videos))
        ledger.free(*videos)
    ledger.free(*old.values())
    if bands > 1:
        ledger.new(gathered_video_bytes(video, band_rows, rows, bands) - video)
    return ledger.peak
