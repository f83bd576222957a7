"""Tiny diffusers transformers with random weights, for tests, benchmarks and tutorials.

Every family at a size that runs in milliseconds on a CPU (configs from STACK-FACTS), seeded so
that every rank builds identical weights, plus matching inputs: `tiny_inputs(family, batch)`
returns the keyword arguments of the model's forward.
"""

from __future__ import annotations

import torch

HEADS, HEAD_DIM, TEXT_DIM = 4, 16, 32


def tiny_transformer(family: str, *, seed: int = 0, layers: int = 2, heads: int = HEADS, **overrides):
    import diffusers

    torch.manual_seed(seed)
    inner = heads * HEAD_DIM
    common = dict(num_attention_heads=heads, attention_head_dim=HEAD_DIM, num_layers=layers)
    if family == "pixart":
        config = dict(common, in_channels=4, out_channels=8, cross_attention_dim=inner, caption_channels=TEXT_DIM,
                      sample_size=8, patch_size=2, norm_type="ada_norm_single", use_additional_conditions=False)
        model = diffusers.PixArtTransformer2DModel(**(config | overrides))
    elif family == "sd3":
        config = dict(common, sample_size=8, patch_size=2, in_channels=16, out_channels=16, joint_attention_dim=TEXT_DIM,
                      caption_projection_dim=inner, pooled_projection_dim=TEXT_DIM, pos_embed_max_size=32)
        model = diffusers.SD3Transformer2DModel(**(config | overrides))
    elif family == "flux":
        config = dict(common, patch_size=1, in_channels=16, num_single_layers=2, joint_attention_dim=TEXT_DIM,
                      pooled_projection_dim=TEXT_DIM, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
        model = diffusers.FluxTransformer2DModel(**(config | overrides))
    elif family == "cogvideox":
        config = dict(common, in_channels=4, out_channels=4, time_embed_dim=32, text_embed_dim=TEXT_DIM,
                      sample_width=8, sample_height=8, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
                      max_text_seq_length=8)
        model = diffusers.CogVideoXTransformer3DModel(**(config | overrides))
    elif family == "dit":
        config = dict(common, in_channels=4, out_channels=8, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
        model = diffusers.DiTTransformer2DModel(**(config | overrides))
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose pixart, sd3, flux, cogvideox or dit")
    return model.eval()


def tiny_inputs(family: str, batch: int = 2, *, height: int = 8, width: int = 8, text_len: int = 6, seed: int = 1):
    """Forward kwargs for `tiny_transformer(family)`: a latent of height × width (in latent pixels)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    text = randn(batch, text_len, TEXT_DIM)
    timestep = torch.rand(batch, generator=g) * 1000
    if family == "pixart":
        return dict(hidden_states=randn(batch, 4, height, width), encoder_hidden_states=text, timestep=timestep,
                    added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    if family == "sd3":
        return dict(hidden_states=randn(batch, 16, height, width), encoder_hidden_states=text,
                    pooled_projections=randn(batch, TEXT_DIM), timestep=timestep)
    if family == "flux":
        tokens = height * width
        img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(height)), torch.arange(float(width)),
                                             indexing="ij"), dim=-1).reshape(tokens, 3).float()
        return dict(hidden_states=randn(batch, tokens, 16), encoder_hidden_states=text,
                    pooled_projections=randn(batch, TEXT_DIM), timestep=timestep / 1000,
                    img_ids=img_ids, txt_ids=torch.zeros(text_len, 3))
    if family == "cogvideox":
        return dict(hidden_states=randn(batch, 3, 4, height, width), encoder_hidden_states=text,
                    timestep=timestep.long())
    if family == "dit":
        return dict(hidden_states=randn(batch, 4, height, width), timestep=timestep.long(),
                    class_labels=torch.arange(batch) % 10)
    raise ValueError(f"unknown tiny family {family!r}")
