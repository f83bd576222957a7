"""The decode peak of HunyuanVideo's and HunyuanVideo-1.5's causal 3D VAEs (AutoencoderKLHunyuanVideo,
AutoencoderKLHunyuanVideo15), whole or in row bands, from their configuration and the latent's shape.

Both decoders run on all their frames at once (HunyuanVideo's on overlapping tiles of frames past 4 latent frames,
its framewise decoding: hunyuan_decoder_frames), so unlike Wan's there is no cache: what lives at once is the
current block's activations, the inputs the callers hold (the decoder holds an up block's input until it returns,
the mid block its first resnet's output through the attention), and the videos of the tiles decoded before.

    causal conv       F.pad by replication (frames causally, rows and columns by one): the padded copy, then
                      the output; in bands the halo rows and the band joined with them first (vae.Bands.pad)
    norm              HunyuanVideo's GroupNorm: its output (in bands: vae.Bands.group_norm's float32 centred
                      copy and its square); HunyuanVideo-1.5's RMS norm: F.normalize's quotient (in float32 for
                      half dtypes), then × scale, × gamma, + bias, the quotient held until it returns
    mid attention     frame-causal over every latent pixel: S = frames × rows × cols tokens of one head. The
                      additive mask is S × S: HunyuanVideo builds it as a bool comparison, a float32 `where` and
                      its cast, HunyuanVideo-1.5 with torch.full in the activations' dtype. In bands the mask is
                      the band's S_b × S_b (diffusers'), its frame-causal check, and the band's queries' rows over
                      every band's keys (S_b × S, vae.Bands.frame_causal_attention), with the gathered K/V.
                      The kernel: a fused one writes no scores (CUDA's memory-efficient kernel takes the mask as a
                      bias); CPU's math path (a 3D mask rules out its flash kernel) writes the scores, its
                      masked sum and their softmax (`scores=True`, what the tests measure on CPU)
    upsampling        HunyuanVideo: nearest ×2 of the first frame and of the others (in time too), joined, then a
                      causal conv; HunyuanVideo-1.5: the conv at the lower resolution into 4 or 8 times the
                      channels, rearranged into 2 × 2 pixels (and 2 frames, all but the first), plus the input
                      rearranged and repeated the same way (its shortcut): both halves live until the sum

At the real sizes the mask is the term to watch, though the last up block's activations stay larger.
HunyuanVideo at 720p decodes tiles of 5 latent frames of 90 × 160: 72,000 tokens, a mask of 5.2e9 entries,
26 GB while its float32 `where` and the bool beside it live; the last up block (128 channels × 17 frames ×
720 × 1280, 4 GB a tensor in bfloat16) peaks at 37 GB, and 8 bands hold 5.5 GB per rank (each rank's rows of
the mask over every key: 1.9 GB). HunyuanVideo-1.5 at 720p × 81 frames decodes all 21 latent frames of 45 × 80
at once: 75,600 tokens, a mask of 11.4 GB in bfloat16, while its last up block's activations are 19 GB each
(128 channels × 81 frames × 720 × 1280): 134 GB whole, which is why its pipeline's examples tile it (tiling is
refused with bands, vae.py), and 18 GB per rank in 8 bands.
Checked against the tensors the decode really makes (lab.measure.PeakTensorBytes, tests/test_vae.py) within 10%,
whole and in bands, float32 and bfloat16, on tiny specimens and on ones whose peak is the mask.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from ..sharding import shard_sizes
from ..vae import hunyuan_decoder_frames
from .video_decode import Ledger, gathered_video_bytes

__all__ = ["hunyuan15_decode_peak_bytes", "hunyuan_decode_peak_bytes"]

# AutoencoderKLHunyuanVideo's framewise decoding as its __init__ sets it (not saved in its config)
FRAMEWISE = dict(use_framewise_decoding=True, tile_sample_min_num_frames=16, tile_sample_stride_num_frames=12)


class _Decoder:
    """The activations of one decoder call on one rank: a ledger, and the sizes and steps both decoders share."""

    def __init__(self, ledger: Ledger, latent_shape, element_bytes: int, bands: int, frames: int, *, scores: bool):
        batch, _, _, rows, cols = latent_shape
        self.ledger, self.batch, self.cols, self.bands = ledger, batch, cols, bands
        self.rows, self.band_rows = rows, -(-rows // bands)
        self.frames, self.element, self.scores = frames, element_bytes, scores

    def size(self, channels, t, scale, element=None, pad=0):  # a tensor of t frames at `scale`× the latent
        rows, cols = self.band_rows * scale + pad, self.cols * scale + pad
        return self.batch * channels * t * rows * cols * (element or self.element)

    def causal_conv(self, c_in, c_out, t, scale, kernel=3):  # replicate F.pad, then the convolution
        if kernel == 1:  # a 1×1×1 one pads nothing, but F.pad still copies
            copy = self.ledger.new(self.size(c_in, t, scale))
            out = self.ledger.new(self.size(c_out, t, scale))
            self.ledger.free(copy)
            return out
        edge = joined = 0
        if self.bands > 1:  # Bands.pad: the received rows and the sent copies, then the band joined with them
            edge = self.ledger.new(4 * self.batch * c_in * t * self.cols * scale * self.element)
            joined = self.ledger.new(self.size(c_in, t, scale) + edge // 2)
        padded = self.ledger.new(self.size(c_in, t + 2, scale, pad=2))
        self.ledger.free(edge, joined)
        out = self.ledger.new(self.size(c_out, t, scale))
        self.ledger.free(padded)
        return out

    def attention_kernel(self, channels, queries, keys, mask):  # SDPA of one head; the mask already alive
        if not self.scores or self.bands > 1:  # in bands, vae.Bands passes a 2D mask: CPU's fused kernel too
            return self.ledger.new(self.batch * queries * channels * self.element)
        # the math path computes in float32: half q, k, v are upcast first
        upcast = 0 if self.element == 4 else self.ledger.new(self.batch * (queries + 2 * keys) * channels * 4)
        scaled_q = self.ledger.new(self.batch * queries * channels * 4)
        scaled_k = self.ledger.new(self.batch * keys * channels * 4)
        scores = self.ledger.new(self.batch * queries * keys * 4)
        self.ledger.free(scaled_k)
        masked = self.ledger.new(self.batch * queries * keys * 4)
        self.ledger.free(scores)
        softmax = self.ledger.new(self.batch * queries * keys * 4)
        self.ledger.free(masked)
        out = self.ledger.new(self.batch * queries * channels * 4)
        self.ledger.free(softmax, scaled_q, upcast)
        if self.element < 4:
            cast = self.ledger.new(self.batch * queries * channels * self.element)
            self.ledger.free(out)
            out = cast
        return out

    def banded_mask_and_kv(self, channels, tokens_per_frame_row):
        """vae.Bands.frame_causal_attention before its kernel: the frame-causal check of the band's own mask (a
        bool comparison and its float mask), the stacked band K/V and their gather, then the band's rows of the
        mask over every band's keys. Returns (what stays alive through the kernel, the keys)."""
        per_row = tokens_per_frame_row * self.frames
        mine, every = self.band_rows * per_row, self.rows * per_row
        e = self.element
        check = self.ledger.new(mine * mine)  # the bool comparison
        check_mask = self.ledger.new(mine * mine * e)
        self.ledger.free(check, check_mask)
        stacked = self.ledger.new(2 * self.batch * mine * channels * e)
        largest = max(shard_sizes(self.rows, self.bands)) * per_row
        received = self.ledger.new(2 * self.batch * self.bands * largest * channels * e)
        both = self.ledger.new(2 * self.batch * every * channels * e)
        self.ledger.free(received, stacked)
        bools = self.ledger.new(mine * every)
        mask = self.ledger.new(mine * every * e)
        self.ledger.free(bools)
        return both + mask, every

    def gather(self, video_bytes) -> None:  # the bands' videos gathered on the rank whose band is largest
        if self.bands > 1:
            self.ledger.new(gathered_video_bytes(video_bytes, self.band_rows, self.rows, self.bands) - video_bytes)


def hunyuan_decode_peak_bytes(vae_config: dict, latent_shape, element_bytes: int, *, bands: int = 1, calls=None) -> int:
    """The most bytes one rank's AutoencoderKLHunyuanVideo decode holds at once (weights and the latent not
    counted), for a latent of `latent_shape` (batch, channels, frames, rows, cols) decoded whole or as the largest
    of `bands` row bands, its decoder called on `calls` latent frames each (vae.hunyuan_decoder_frames; by default
    as diffusers' framewise decoding tiles them, FRAMEWISE), `element_bytes` per activation. Its attention's mask is 4D (batch, heads, S, S): a fused kernel
    takes it on CPU too, and no scores are written."""
    batch, z, frames, rows, cols = latent_shape
    ratio = vae_config.get("temporal_compression_ratio", 4)
    calls = calls or hunyuan_decoder_frames(SimpleNamespace(temporal_compression_ratio=ratio, **FRAMEWISE), frames)
    channels = list(reversed(vae_config.get("block_out_channels", (128, 256, 512, 512))))
    blocks = vae_config.get("layers_per_block", 2) + 1
    in_space = _log2(vae_config.get("spatial_compression_ratio", 8))
    in_time = _log2(vae_config.get("temporal_compression_ratio", 4))
    attend = vae_config.get("mid_block_add_attention", True)
    out_channels, e, wide = vae_config.get("out_channels", 3), element_bytes, 4
    ledger, videos = Ledger(), []  # videos: each earlier tile's output, kept until they are blended and joined
    for call, t_latent in enumerate(calls):
        d = _Decoder(ledger, latent_shape, e, bands, t_latent, scores=False)
        if bands > 1 and call == 0:
            ledger.new(d.size(z, frames, 1))  # the band's rows of the latent, made contiguous (vae.py)

        def group_norm(c, t, scale, d=d):  # returns the output; the input stays with the caller
            if bands == 1:
                return ledger.new(d.size(c, t, scale))
            upcast = ledger.new(d.size(c, t, scale, wide)) if e < 4 else 0  # grouped.float()
            centred = ledger.new(d.size(c, t, scale, wide))
            ledger.free(upcast)
            square = ledger.new(d.size(c, t, scale, wide))
            ledger.free(square)
            if e < 4:
                out = ledger.new(d.size(c, t, scale))
                ledger.free(centred)
                return out
            return centred

        def resnet(c_in, c_out, t, scale, d=d):  # input alive in the caller (or made contiguous here)
            normed = group_norm(c_in, t, scale)
            act = ledger.new(d.size(c_in, t, scale))
            ledger.free(normed)
            h = d.causal_conv(c_in, c_out, t, scale)
            ledger.free(act)
            normed = group_norm(c_out, t, scale)
            ledger.free(h)
            act = ledger.new(d.size(c_out, t, scale))
            ledger.free(normed)
            h = d.causal_conv(c_out, c_out, t, scale)
            ledger.free(act)
            shortcut = d.causal_conv(c_in, c_out, t, scale, kernel=1) if c_in != c_out else 0
            out = ledger.new(d.size(c_out, t, scale))
            ledger.free(h, shortcut)
            return out

        def attention(c, t, d=d):  # input: the (batch, S, c) flattened copy, alive in the caller
            tokens = t * d.band_rows * cols
            if bands == 1:  # prepare_causal_attention_mask: x <= y (bool), torch.where (float32), .to(dtype)
                bools = ledger.new(tokens * tokens)
                where = ledger.new(tokens * tokens * wide)
                ledger.free(bools)
                if e < 4:
                    cast = ledger.new(tokens * tokens * e)
                    ledger.free(where)
                    where = cast
                mask, keys, kv = where, tokens, 0
            else:  # the band's own mask as above, then Bands' check, gathered K/V and mask rows
                bools = ledger.new(tokens * tokens)
                own = ledger.new(tokens * tokens * wide)
                ledger.free(bools)
                if e < 4:
                    cast = ledger.new(tokens * tokens * e)
                    ledger.free(own)
                    own = cast
            if bands == 1:
                normed = ledger.new(d.size(c, t, 1))  # group norm of the transposed tokens
            else:  # Bands.group_norm reshapes the transposed tokens: a copy, then as group_norm
                copy = ledger.new(d.size(c, t, 1))
                normed = group_norm(c, t, 1)
                ledger.free(copy)
            qkv = ledger.new(3 * d.size(c, t, 1))
            ledger.free(normed)
            if bands > 1:
                kv, keys = d.banded_mask_and_kv(c, cols)
                mask = own
            out = d.attention_kernel(c, tokens, keys, mask)
            ledger.free(kv)
            projected = ledger.new(d.size(c, t, 1))
            ledger.free(out)
            summed = ledger.new(d.size(c, t, 1))
            ledger.free(projected)
            rescaled = ledger.new(d.size(c, t, 1))
            ledger.free(summed, qkv, mask)
            return rescaled

        t, scale = t_latent, 1
        quant = ledger.new(d.size(z, t, 1))  # post_quant_conv of the tile
        x = d.causal_conv(z, channels[0], t, scale)
        ledger.free(quant)
        held = x  # the decoder holds the mid block's input until it returns
        x = resnet(channels[0], channels[0], t, scale)
        if attend:  # permute(...).flatten(1, 3) of (batch, channels, frames, rows, cols): a view
            y = attention(channels[0], t)
            ledger.free(x)
            x = ledger.new(d.size(channels[0], t, 1))  # the resnet's .contiguous() of the permuted tokens
            ledger.free(y)
        y = resnet(channels[0], channels[0], t, scale)
        ledger.free(x, held)
        x, previous = y, channels[0]
        for i, out in enumerate(channels):
            held = x  # the decoder holds an up block's input until it returns
            for j in range(blocks):
                y = resnet(previous if j == 0 else out, out, t, scale)
                if j:
                    ledger.free(x)
                x = y
            previous = out
            spatial = i < in_space
            temporal = i < in_time if in_time == 3 else len(channels) - 1 - in_time <= i < len(channels) - 1
            if spatial or temporal:
                s = 2 if spatial else 1
                first = ledger.new(d.size(out, 1, scale * s))  # the first frame, nearest ×2 in space
                rest = 0
                if t > 1:
                    contiguous = ledger.new(d.size(out, t - 1, scale))
                    rest = ledger.new(d.size(out, (t - 1) * (2 if temporal else 1), scale * s))
                    ledger.free(contiguous)
                t, scale = (2 * t - 1 if temporal else t), scale * s
                joined = ledger.new(d.size(out, t, scale)) if rest else 0
                y = d.causal_conv(out, out, t, scale)
                ledger.free(first, rest, joined, x)
                x = y
            ledger.free(held)
        normed = group_norm(channels[-1], t, scale)
        act = ledger.new(d.size(channels[-1], t, scale))
        ledger.free(normed)
        y = d.causal_conv(channels[-1], out_channels, t, scale)
        ledger.free(act, x)
        videos.append(y)
    if len(videos) > 1:  # the tiles joined (the blend works in place)
        whole_frames = (frames - 1) * 2**in_time + 1
        video = ledger.new(batch * out_channels * whole_frames * d.band_rows * 2**in_space * cols * 2**in_space * e)
        ledger.free(*videos)
    else:
        video = videos[0]
    d.gather(video)
    return ledger.peak


def hunyuan15_decode_peak_bytes(
    vae_config: dict, latent_shape, element_bytes: int, *, bands: int = 1, scores: bool = False
) -> int:
    """The most bytes one rank's AutoencoderKLHunyuanVideo15 decode holds at once (weights and the latent not
    counted), for a latent of `latent_shape` (batch, channels, frames, rows, cols) decoded whole or as the largest
    of `bands` row bands, `element_bytes` per activation (its RMS norm computes in float32 for half dtypes).
    `scores`: SDPA's math path (CPU) writes the mid attention's scores."""
    batch, z, frames, rows, cols = latent_shape
    channels = list(reversed(vae_config.get("block_out_channels", (128, 256, 512, 1024, 1024))))
    blocks = vae_config.get("layers_per_block", 2) + 1
    in_space = _log2(vae_config.get("spatial_compression_ratio", 16))
    in_time = _log2(vae_config.get("temporal_compression_ratio", 4))
    match = vae_config.get("upsample_match_channel", True)
    out_channels, e, wide = vae_config.get("out_channels", 3), element_bytes, 4
    ledger = Ledger()
    d = _Decoder(ledger, latent_shape, e, bands, frames, scores=scores)
    size = d.size

    def rms_norm(c, t, scale):  # the input stays with the caller; returns the norm's output
        upcast = e < 4
        f32 = ledger.new(size(c, t, scale, wide)) if upcast else 0  # x.float()
        norms = ledger.new(2 * size(1, t, scale, wide if upcast else e))  # the norm and its clamp
        quotient = ledger.new(size(c, t, scale, wide if upcast else e))
        ledger.free(f32, norms)
        if upcast:
            cast = ledger.new(size(c, t, scale))
            ledger.free(quotient)
            quotient = cast
        scaled = ledger.new(size(c, t, scale))
        gamma = ledger.new(size(c, t, scale))
        ledger.free(scaled)
        out = ledger.new(size(c, t, scale))  # + bias (0.0): one more tensor
        ledger.free(gamma, quotient)
        return out

    def resnet(c_in, c_out, t, scale):  # input alive in the caller
        normed = rms_norm(c_in, t, scale)
        act = ledger.new(size(c_in, t, scale))
        ledger.free(normed)
        h = d.causal_conv(c_in, c_out, t, scale)
        ledger.free(act)
        normed = rms_norm(c_out, t, scale)
        ledger.free(h)
        act = ledger.new(size(c_out, t, scale))
        ledger.free(normed)
        h = d.causal_conv(c_out, c_out, t, scale)
        ledger.free(act)
        shortcut = ledger.new(size(c_out, t, scale)) if c_in != c_out else 0  # a 1×1×1 nn.Conv3d
        out = ledger.new(size(c_out, t, scale))
        ledger.free(h, shortcut)
        return out

    def attention(c, t):  # input alive in the caller (its identity)
        tokens = t * d.band_rows * cols
        normed = rms_norm(c, t, 1)
        qkv = ledger.new(3 * size(c, t, 1))
        contiguous = ledger.new(3 * size(c, t, 1))  # permute(...).contiguous() of each
        ledger.free(qkv)
        own = ledger.new(tokens * tokens * e)  # prepare_causal_attention_mask: torch.full, filled in place
        kv, keys = d.banded_mask_and_kv(c, cols) if bands > 1 else (0, tokens)
        out = d.attention_kernel(c, tokens, keys, own)
        ledger.free(kv)
        projected = ledger.new(size(c, t, 1))
        ledger.free(out)
        summed = ledger.new(size(c, t, 1))
        ledger.free(projected, normed, contiguous, own)
        return summed

    def upsample(c_in, c_out, t, scale, temporal):  # input alive in the caller; returns (output, frames)
        factor = 8 if temporal else 4
        h = d.causal_conv(c_in, c_out * factor, t, scale)
        up = scale * 2
        if temporal:  # first frame and the others rearranged (copies), joined; the input's likewise, repeated
            t_up = 2 * t - 1
            h_first = ledger.new(size(2 * c_out, 1, up))
            h_next = ledger.new(size(c_out, 2 * (t - 1), up))
            joined = ledger.new(size(c_out, t_up, up))
            ledger.free(h)
            x_first = ledger.new(size(c_in, 1, scale))
            repeated = ledger.new(size(c_out, 1, up))
            ledger.free(x_first)
            x_next = ledger.new(size(c_in, t - 1, scale))
            repeated_next = ledger.new(size(c_out, 2 * (t - 1), up))
            ledger.free(x_next)
            shortcut = ledger.new(size(c_out, t_up, up))
            out = ledger.new(size(c_out, t_up, up))
            ledger.free(h_first, h_next, joined, repeated, repeated_next, shortcut)
            return out, t_up
        rearranged = ledger.new(size(c_out, t, up))
        ledger.free(h)
        repeated = ledger.new(size(c_out, t, up))
        shortcut = ledger.new(size(c_out, t, up))
        ledger.free(repeated)
        out = ledger.new(size(c_out, t, up))
        ledger.free(rearranged, shortcut)
        return out, t

    if bands > 1:
        ledger.new(size(z, frames, 1))  # the band's rows of the latent, made contiguous (vae.py)
    t, scale = frames, 1
    conv = d.causal_conv(z, channels[0], t, scale)
    repeated = ledger.new(size(channels[0], t, scale))  # z.repeat_interleave, added to conv_in's output
    x = ledger.new(size(channels[0], t, scale))
    ledger.free(conv, repeated)
    held = x  # the decoder holds the mid block's input until it returns
    x = resnet(channels[0], channels[0], t, scale)
    if vae_config.get("mid_block_add_attention", True):
        y = attention(channels[0], t)
        ledger.free(x)
        x = y
    y = resnet(channels[0], channels[0], t, scale)
    ledger.free(x, held)
    x, previous = y, channels[0]
    for i, out in enumerate(channels):
        held = x  # the decoder holds an up block's input until it returns
        for j in range(blocks):
            y = resnet(previous if j == 0 else out, out, t, scale)
            if j:
                ledger.free(x)
            x = y
        spatial, temporal = i < in_space, i < in_time
        previous = out
        if spatial or temporal:
            previous = channels[i + 1] if match else out
            y, t = upsample(out, previous, t, scale, temporal)
            scale *= 2
            ledger.free(x)
            x = y
        ledger.free(held)
    normed = rms_norm(channels[-1], t, scale)
    act = ledger.new(size(channels[-1], t, scale))
    ledger.free(normed)
    video = d.causal_conv(channels[-1], out_channels, t, scale)
    ledger.free(act, x)
    d.gather(video)
    return ledger.peak


def _log2(ratio: int) -> int:
    return round(math.log2(ratio))
