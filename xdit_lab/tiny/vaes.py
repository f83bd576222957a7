"""Tiny VAEs with random weights (seeded), each family's own autoencoder class at a few channels, and LTX-2's
audio VAE and vocoder. Their layouts keep what the parallel decode must get right (vae.py): the same blocks,
norms, attention and upsampling as the published models, at widths of 4 to 32 channels.
A family's TINY names its parts by builder (families/tiny_spec.Part); xdit_lab.tiny finds the builder here,
in tokenizers.py or in encoders.py.
"""

from __future__ import annotations

import torch


def vae_blocks(down: str, up: str, widths: tuple[int, ...], groups: int) -> dict:
    """A tiny VAE's blocks, as the image and video VAEs of diffusers take them: one `down` and one `up`
    block per width of `widths`, one layer each, their norms in `groups` groups."""
    n = len(widths)
    return dict(
        down_block_types=(down,) * n,
        up_block_types=(up,) * n,
        block_out_channels=widths,
        layers_per_block=1,
        norm_num_groups=groups,
    )


def hunyuan_vae(seed: int, latent_channels: int):
    """HunyuanVideo's causal 3D VAE at its smallest: 8x spatial, 4x temporal compression, as the real one's."""
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(seed)
    blocks = vae_blocks("HunyuanVideoDownBlock3D", "HunyuanVideoUpBlock3D", (8, 8, 8, 8), groups=4)
    compression = dict(spatial_compression_ratio=8, temporal_compression_ratio=4)
    return AutoencoderKLHunyuanVideo(
        latent_channels=latent_channels, scaling_factor=0.476986, **blocks, **compression
    ).eval()


def hunyuan15_vae(seed: int, latent_channels: int):
    """HunyuanVideo-1.5's causal 3D VAE at its smallest: 16x spatial, 4x temporal compression, as the real one's."""
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo15(
        latent_channels=latent_channels, block_out_channels=(8,) * 5, layers_per_block=1
    ).eval()


def image_vae(seed: int, latent_channels: int, kind: str = "AutoencoderKL", **config):
    """Two blocks: one 2x downsampling (vae_scale_factor 2). kind: diffusers' class, AutoencoderKL or
    Flux.2's AutoencoderKLFlux2 (the same blocks, and a batch norm over 2 × 2 patches of the latent)."""
    import diffusers

    torch.manual_seed(seed)
    blocks = vae_blocks("DownEncoderBlock2D", "UpDecoderBlock2D", (8, 16), groups=8)
    return getattr(diffusers, kind)(latent_channels=latent_channels, sample_size=16, **blocks, **config).eval()


def flux2_vae(seed: int, latent_channels: int):
    """Flux.2's VAE, its batch norm's running statistics random (not 0 and 1): the pipeline undoes
    them before decoding, and a decode that did not would differ."""
    vae = image_vae(seed, latent_channels, "AutoencoderKLFlux2")
    vae.bn.running_mean.normal_()
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def video_vae(seed: int):
    """Three blocks: 4x spatial and (first two blocks) 4x temporal compression, like CogVideoX's 8x / 4x."""
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(seed)
    blocks = vae_blocks("CogVideoXDownBlock3D", "CogVideoXUpBlock3D", (8, 8, 8), groups=2)
    sample = dict(sample_height=32, sample_width=32)
    return AutoencoderKLCogVideoX(latent_channels=4, temporal_compression_ratio=4, **blocks, **sample).eval()


def _causal_3d_vae(cls_name: str, seed: int, latent_channels: int, **shape):
    """Wan's causal 3D VAE family (AutoencoderKLWan, AutoencoderKLQwenImage), with zero means, unit stds."""
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, cls_name)(
        z_dim=latent_channels,
        num_res_blocks=1,
        latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels,
        **shape,
    ).eval()


def qwen_vae(seed: int, latent_channels: int):
    """Qwen-Image's VAE (Wan's causal 3D VAE, one frame at a time) at its smallest: 4x spatial."""
    shape = dict(base_dim=8, dim_mult=[1, 2, 4], temperal_downsample=[False, True])
    return _causal_3d_vae("AutoencoderKLQwenImage", seed, latent_channels, **shape)


def qwen_edit_vae(seed: int, latent_channels: int):
    """Qwen-Image's VAE for its edit pipelines, 32x spatial, two channels wide: they encode the reference image at
    1024² pixels whatever the size asked for (1024² / 32² / 2 × 2 packed = 256 tokens), in well under a second."""
    shape = dict(base_dim=2, dim_mult=[1] * 6, temperal_downsample=[False] * 5)
    return _causal_3d_vae("AutoencoderKLQwenImage", seed, latent_channels, **shape)


def wan_vae(seed: int, latent_channels: int):
    """Wan's 3D causal VAE at its smallest: 8x spatial, 4x temporal compression, as Wan 2.1's."""
    shape = dict(base_dim=4, dim_mult=[1, 1, 1, 1], temperal_downsample=[False, True, True])
    return _causal_3d_vae("AutoencoderKLWan", seed, latent_channels, **shape)


def dc_vae(seed: int, latent_channels: int, scaling_factor: float):
    """A deep-compression autoencoder (Sana's AutoencoderDC) at its smallest: three stages, 4x spatial, the last
    with DC-AE's linear-attention block, as the real one's deep stages."""
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    stages = dict(
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
    )  # fmt: skip
    return AutoencoderDC(
        in_channels=3, latent_channels=latent_channels, attention_head_dim=2, downsample_block_type="conv",
        upsample_block_type="interpolate", scaling_factor=scaling_factor, **stages,
    ).eval()  # fmt: skip


def ltx2_vae(seed: int, latent_channels: int):
    """LTX-2's video VAE at its smallest: two spatio-temporal blocks, 4x spatial and 4x temporal compression (5
    frames of 32 × 32 pixels: 2 latent frames of 8 × 8), a decoder that is not causal, as LTX-2's."""
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(seed)
    twice = ("spatiotemporal", "spatiotemporal")
    return AutoencoderKLLTX2Video(
        latent_channels=latent_channels, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        down_block_types=("LTX2VideoDownBlock3D",) * 2, layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True), decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False), downsample_type=twice, upsample_type=twice,
        upsample_residual=(False, False), upsample_factor=(1, 1), patch_size=1, patch_size_t=1, decoder_causal=False,
    ).eval()  # fmt: skip


def ltx2_audio_vae(seed: int):
    """LTX-2's audio VAE at its smallest: 2 latent channels over 8 mel bins (2 latent bins: 4 features an audio
    token), 4x in time, 16 kHz with a hop of 160 (25 latent frames a second)."""
    from diffusers import AutoencoderKLLTX2Audio

    torch.manual_seed(seed)
    return AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    ).eval()  # fmt: skip


def ltx2_vocoder(seed: int):
    """LTX-2's vocoder (mel spectrogram to waveform), two stereo channels of 2 × 8 mel bins in, 4x upsampling."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    return LTX2Vocoder(
        in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    ).eval()  # fmt: skip
