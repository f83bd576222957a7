"""Tiny diffusers transformers with random weights, for tests, benchmarks and tutorials.

Every family at a size that runs in milliseconds on a CPU (the smallest configurations each family's
constructor accepts: heads × head_dim 4 × 16, two layers, text width 32), seeded so
that every rank builds identical weights, plus matching inputs: `tiny_inputs(family, batch)`
returns the keyword arguments of the model's forward. Whole pipelines around them: tiny.py.
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
        config = dict(
            common,
            in_channels=4,
            out_channels=8,
            cross_attention_dim=inner,
            caption_channels=TEXT_DIM,
            sample_size=8,
            patch_size=2,
            norm_type="ada_norm_single",
            use_additional_conditions=False,
        )
        model = diffusers.PixArtTransformer2DModel(**(config | overrides))
    elif family == "sd3":
        config = dict(
            common,
            sample_size=8,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            joint_attention_dim=TEXT_DIM,
            caption_projection_dim=inner,
            pooled_projection_dim=TEXT_DIM,
            pos_embed_max_size=32,
        )
        model = diffusers.SD3Transformer2DModel(**(config | overrides))
    elif family == "flux":
        config = dict(
            common,
            patch_size=1,
            in_channels=16,
            num_single_layers=2,
            joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM,
            guidance_embeds=False,
            axes_dims_rope=(4, 6, 6),
        )
        model = diffusers.FluxTransformer2DModel(**(config | overrides))
    elif family == "flux2":  # modelled on diffusers' own test of Flux2Transformer2DModel
        config = dict(
            common,
            patch_size=1,
            in_channels=16,
            num_single_layers=2,
            joint_attention_dim=TEXT_DIM,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        )
        model = diffusers.Flux2Transformer2DModel(**(config | overrides))
    elif family == "qwenimage":  # modelled on diffusers' own test of QwenImageTransformer2DModel
        config = dict(
            common,
            patch_size=2,
            in_channels=16,
            out_channels=4,
            joint_attention_dim=TEXT_DIM,
            axes_dims_rope=(8, 4, 4),
        )
        model = diffusers.QwenImageTransformer2DModel(**(config | overrides))
    elif family == "hunyuanvideo":  # modelled on diffusers' own test of HunyuanVideoTransformer3DModel
        config = dict(
            common,
            in_channels=4,
            out_channels=4,
            num_single_layers=2,
            num_refiner_layers=1,
            patch_size=2,
            patch_size_t=1,
            text_embed_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM,
            rope_axes_dim=(4, 6, 6),
            guidance_embeds=True,  # HunyuanVideo is guidance-distilled
        )
        model = diffusers.HunyuanVideoTransformer3DModel(**(config | overrides))
    elif family == "cogvideox":
        config = dict(
            common,
            in_channels=4,
            out_channels=4,
            time_embed_dim=32,
            text_embed_dim=TEXT_DIM,
            sample_width=8,
            sample_height=8,
            sample_frames=9,
            patch_size=2,
            temporal_compression_ratio=4,
            max_text_seq_length=8,
        )
        model = diffusers.CogVideoXTransformer3DModel(**(config | overrides))
    elif family == "wan":  # modelled on diffusers' own test of WanTransformer3DModel
        config = dict(
            common,
            patch_size=(1, 2, 2),
            in_channels=4,
            out_channels=4,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=32,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
        model = diffusers.WanTransformer3DModel(**(config | overrides))
    elif family == "dit":
        config = dict(common, in_channels=4, out_channels=8, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
        model = diffusers.DiTTransformer2DModel(**(config | overrides))
    else:
        raise ValueError(
            f"unknown tiny family {family!r}; choose pixart, sd3, flux, flux2, qwenimage, hunyuanvideo, cogvideox, wan or dit"
        )
    return model.eval()


def tiny_inputs(family: str, batch: int = 2, *, height: int = 8, width: int = 8, text_len: int = 6, seed: int = 1):
    """Forward kwargs for `tiny_transformer(family)`: a latent of height × width (in latent pixels)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    text = randn(batch, text_len, TEXT_DIM)
    timestep = torch.rand(batch, generator=g) * 1000
    if family == "pixart":
        return dict(
            hidden_states=randn(batch, 4, height, width),
            encoder_hidden_states=text,
            timestep=timestep,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        )
    if family == "sd3":
        return dict(
            hidden_states=randn(batch, 16, height, width),
            encoder_hidden_states=text,
            pooled_projections=randn(batch, TEXT_DIM),
            timestep=timestep,
        )
    if family in ("flux", "flux2"):  # ids per token: (0, row, column), Flux.2's with a 4th axis (text: its index)
        axes = 3 if family == "flux" else 4
        grid = torch.meshgrid(
            torch.zeros(1),
            torch.arange(float(height)),
            torch.arange(float(width)),
            *[torch.zeros(1)] * (axes - 3),
            indexing="ij",
        )
        txt_ids = torch.zeros(text_len, axes)
        txt_ids[:, 3:] = torch.arange(float(text_len))[:, None]
        inputs = dict(hidden_states=randn(batch, height * width, 16), encoder_hidden_states=text)
        if family == "flux":
            inputs["pooled_projections"] = randn(batch, TEXT_DIM)
        img_ids = torch.stack(grid, dim=-1).reshape(height * width, axes)
        return dict(inputs, timestep=timestep / 1000, img_ids=img_ids, txt_ids=txt_ids)
    if family == "qwenimage":  # 2 × 2 latent pixels packed per token; padded text, a different length per sample
        grid = (1, height // 2, width // 2)
        valid = torch.arange(text_len)[None, :] < (text_len - torch.arange(batch) % 3)[:, None]
        return dict(
            hidden_states=randn(batch, grid[1] * grid[2], 16),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=valid,
            timestep=timestep / 1000,
            img_shapes=[[grid]] * batch,
        )
    if family == "hunyuanvideo":  # two latent frames; padded text, a different length per sample
        valid = torch.arange(text_len)[None, :] < (text_len - torch.arange(batch) % 3)[:, None]
        return dict(
            hidden_states=randn(batch, 4, 2, height, width),
            encoder_hidden_states=text,
            encoder_attention_mask=valid.long(),
            pooled_projections=randn(batch, TEXT_DIM),
            timestep=timestep.long(),
            guidance=torch.full((batch,), 6000.0),  # HunyuanVideoPipeline's guidance_scale 6 × 1000
        )
    if family == "cogvideox":
        return dict(
            hidden_states=randn(batch, 3, 4, height, width), encoder_hidden_states=text, timestep=timestep.long()
        )
    if family == "wan":  # two latent frames
        return dict(
            hidden_states=randn(batch, 4, 2, height, width), encoder_hidden_states=text, timestep=timestep.long()
        )
    if family == "dit":
        return dict(
            hidden_states=randn(batch, 4, height, width),
            timestep=timestep.long(),
            class_labels=torch.arange(batch) % 10,
        )
    raise ValueError(f"unknown tiny family {family!r}")
