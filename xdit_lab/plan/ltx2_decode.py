"""The decode peak of LTX-2's video VAE (AutoencoderKLLTX2Video), whole or in row bands, from its configuration and
the latent's shape.

Its decoder runs on all frames at once, not causally (LTX-2's decode): no cache, no attention. What lives at once
is the current block's activations and the inputs the callers hold (the decoder holds the mid block's and each up
block's input until it returns).

    conv          LTX2VideoCausalConv3d: the first and last frames repeated (copies, alive until it returns), joined
                  before and after the frames, then nn.Conv3d pads the rows and columns by reflection (F.pad: a
                  copy) and convolves; in bands the halo rows (two received, two sent) and the band joined with
                  them before the reflection (vae.Bands.pad)
    RMS norm      per pixel over the channels: x², its mean, the root, the quotient
    resnet        norm, SiLU, conv, norm, SiLU, conv; a resnet that changes the channels also a LayerNorm of its
                  input and a 1×1×1 shortcut; the sum
    upsampling    the conv into (stride product / upsample factor) times the channels, rearranged into 2 × 2 pixels
                  and 2 frames (a copy, then all but the first frame); with upsample_residual the input rearranged
                  the same way and repeated (its shortcut): both halves live until the sum
    the end       RMS norm, SiLU, conv_out into 3 × patch² channels, the patch unpacked into pixels (a copy)

At LTX-2's 704 × 1280 × 121 frames (16 latent frames of 22 × 40, 4 × 4 pixels a patch) the peak, 9.3 GB in
bfloat16, is a resnet's convolution in the last up block (128 channels × 121 frames × 176 × 320, 1.7 GB a
tensor): the resnet's input, its SiLU, the frames joined, their reflected copy and the output, beside the block's
input. In bands (vae.py) every activation shrinks with the band but the gathered video (3 channels at full size):
4.7 GB per rank in 2 bands, 1.5 GB in 8, where the gather of the video is the peak.
Checked against the tensors the decode really makes (lab.measure.PeakTensorBytes, tests/test_vae.py) within 10%,
whole and in bands, float32 and bfloat16.
"""

from __future__ import annotations

from .video_decode import Ledger, gathered_video_bytes

__all__ = ["ltx2_decode_peak_bytes"]

STRIDES = dict(spatial=(1, 2), temporal=(2, 1), spatiotemporal=(2, 2))  # upsample_type: (in time, in space)


def ltx2_decode_peak_bytes(vae_config: dict, latent_shape, element_bytes: int, *, bands: int = 1) -> int:
    """The most bytes one rank's AutoencoderKLLTX2Video decode holds at once (weights and the latent not counted),
    for a latent of `latent_shape` (batch, channels, frames, rows, cols) decoded whole or as the largest of `bands`
    row bands (xdit_lab/vae.py), `element_bytes` per activation. Its decoder as LTX-2.0 sets it: no timestep
    conditioning and no noise injected (neither's tensors are counted); a decoder that injects noise decodes whole
    on every rank (vae.apply_parallel_vae), and is counted whole here."""
    c = vae_config
    noise = c.get("decoder_inject_noise") or ()
    if any(noise) if isinstance(noise, (list, tuple)) else noise:
        bands = 1
    batch, z, frames, rows, cols = latent_shape
    band_rows = -(-rows // bands)
    blocks = len(c.get("decoder_layers_per_block", (5, 5, 5, 5)))
    layers = list(reversed(c.get("decoder_layers_per_block", (5, 5, 5, 5))))
    widths = list(reversed(c.get("decoder_block_out_channels", (256, 512, 1024))))
    scaling = c.get("decoder_spatio_temporal_scaling", (True, True, True))
    scaling = list(reversed(scaling if isinstance(scaling, (list, tuple)) else [scaling] * (blocks - 1)))
    residual = c.get("upsample_residual", (True, True, True))
    residual = list(reversed(residual if isinstance(residual, (list, tuple)) else [residual] * (blocks - 1)))
    factors = list(reversed(c.get("upsample_factor", (2, 2, 2))))
    kinds = c.get("upsample_type", ("spatiotemporal",) * (blocks - 1))
    patch, patch_t = c.get("patch_size", 4), c.get("patch_size_t", 1)
    out_channels = c.get("out_channels", 3) * patch**2 * patch_t
    e, ledger = element_bytes, Ledger()
    scale_rows = scale_cols = 1  # the running size over the latent's, in rows and columns

    def size(channels, t, pad=0):  # a tensor of t frames at the running size (a band's rows)
        return batch * channels * t * (band_rows * scale_rows + pad) * (cols * scale_cols + pad) * e

    def conv(c_in, c_out, t):  # 3×3×3, its input alive in the caller; returns the output
        ends = ledger.new(2 * size(c_in, 1))  # the first and last frames repeated
        joined = ledger.new(size(c_in, t + 2))
        received = with_halo = 0
        if bands > 1:  # Bands.pad: two rows received and two sent (copies, freed once exchanged), then the join
            row = batch * c_in * (t + 2) * cols * scale_cols * e
            sent = ledger.new(2 * row)
            received = ledger.new(2 * row)
            ledger.free(sent)
            with_halo = ledger.new(size(c_in, t + 2) + 2 * row)
        padded = ledger.new(size(c_in, t + 2, pad=2))  # F.pad by reflection
        ledger.free(received, with_halo)
        out = ledger.new(size(c_out, t))
        ledger.free(padded, joined, ends)
        return out

    def rms_norm(channels, t):  # the input stays with the caller
        square = ledger.new(size(channels, t))
        mean = ledger.new(size(1, t))
        ledger.free(square)
        root = ledger.new(2 * size(1, t))  # mean + eps, its root
        out = ledger.new(size(channels, t))
        ledger.free(mean, root)
        return out

    def norm_act_conv(c_in, c_out, t, given=0):  # frees `given` (its input, the caller's no more) once normed
        normed = rms_norm(c_in, t)
        ledger.free(given)
        act = ledger.new(size(c_in, t))
        ledger.free(normed)
        out = conv(c_in, c_out, t)
        ledger.free(act)
        return out

    def resnet(c_in, c_out, t):  # input alive in the caller
        h = norm_act_conv(c_in, c_out, t)
        y = norm_act_conv(c_out, c_out, t, given=h)
        shortcut = 0
        if c_in != c_out:  # LayerNorm over the channels (its input moved, not copied), a 1×1×1 conv
            normed = ledger.new(size(c_in, t))
            shortcut = ledger.new(size(c_out, t))
            ledger.free(normed)
        out = ledger.new(size(c_out, t))
        ledger.free(y, shortcut)
        return out

    def upsample(c_in, t, kind, factor, with_residual):  # input alive in the caller; returns (output, its frames)
        nonlocal scale_rows, scale_cols
        time, space = STRIDES[kind]
        grow = time * space * space  # the elements each input element becomes
        shortcut = 0
        if with_residual:  # the input rearranged (a copy), then repeated: the repeat stays, sliced
            rearranged = ledger.new(size(c_in, t))
            shortcut = ledger.new(size(c_in, t) * grow // factor)
            ledger.free(rearranged)
        h = conv(c_in, c_in * grow // factor, t)
        moved = ledger.new(h)  # rearranged into frames and pixels: a copy
        ledger.free(h)
        t_up, c_out = t * time - (time - 1), c_in // factor
        scale_rows, scale_cols = scale_rows * space, scale_cols * space
        out = moved
        if with_residual:
            out = ledger.new(size(c_out, t_up))
            ledger.free(moved, shortcut)
        return out, t_up

    if bands > 1:
        ledger.new(size(z, frames))  # the band's rows of the latent, made contiguous (vae.py)
    t = frames
    x = conv(z, widths[0], t)
    held = x  # the decoder holds the mid block's input until it returns
    for j in range(layers[0]):
        y = resnet(widths[0], widths[0], t)
        if j:
            ledger.free(x)
        x = y
    if layers[0]:
        ledger.free(held)
    channels = widths[0]
    for i, width in enumerate(widths):
        held = x  # the decoder holds an up block's input until it returns
        first, out = channels // factors[i], width // factors[i]
        fresh = False  # whether x is this block's own (freed as the block moves on)
        if first != out:  # the block's conv_in: a resnet that changes the channels
            x, fresh = resnet(first, out, t), True
        if scaling[i]:
            y, t = upsample(out * factors[i], t, kinds[i], factors[i], residual[i])
            if fresh:
                ledger.free(x)
            x, fresh = y, True
        for _ in range(layers[i + 1]):
            y = resnet(out, out, t)
            if fresh:
                ledger.free(x)
            x, fresh = y, True
        if fresh:
            ledger.free(held)
        channels = out
    normed = rms_norm(channels, t)
    ledger.free(x)  # the decoder rebinds its output: the last up block's output goes
    act = ledger.new(size(channels, t))
    ledger.free(normed)
    h = conv(channels, out_channels, t)
    ledger.free(act)
    video = ledger.new(h)  # the patch unpacked into pixels: a copy
    ledger.free(h)
    if bands > 1:
        ledger.new(gathered_video_bytes(video, band_rows, rows, bands) - video)
    return ledger.peak
