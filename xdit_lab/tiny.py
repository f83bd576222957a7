"""Tiny diffusers pipelines with random weights, for tests, benchmarks and tutorials.

`save_tiny_pipeline(family, path)` builds a whole stock diffusers pipeline around a tiny transformer
(tiny_models.py: every family at a size that runs in milliseconds on a CPU; `tiny_transformer` and
`tiny_inputs` are importable from here too) with text encoders, local tokenizers, VAE and scheduler,
all random and seeded, and saves it as an ordinary diffusers folder; `tiny_pipeline_kwargs(family)`
are the call arguments that run it in well under a second on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tiny_models import HEAD_DIM, HEADS, TEXT_DIM, tiny_inputs, tiny_transformer
from .tiny_parts import (
    HUNYUAN_TEMPLATE,
    MAX_TOKENS,
    clip_encoder,
    clip_tokenizer,
    flux2_vae,
    hunyuan_vae,
    image_vae,
    llama_encoder,
    llama_tokenizer,
    mistral3_encoder,
    mistral_tokenizer,
    qwen_tokenizer,
    qwen_vae,
    qwen_vl_encoder,
    t5_encoder,
    t5_tokenizer,
    video_vae,
    wan_vae,
)

__all__ = [  # tiny_models' names too: callers import every tiny thing from here
    "HEADS",
    "HEAD_DIM",
    "MAX_TOKENS",
    "PIPELINES",
    "TEXT_DIM",
    "save_tiny_pipeline",
    "tiny_inputs",
    "tiny_pipeline",
    "tiny_pipeline_kwargs",
    "tiny_transformer",
]

# ---- whole pipelines (their parts: tiny_parts.py) ---------------------------------------------------------------

PIPELINES = {
    "pixart": "PixArtAlphaPipeline",
    "pixart-sigma": "PixArtSigmaPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "flux2": "Flux2Pipeline",
    "cogvideox": "CogVideoXPipeline",
    "wan": "WanPipeline",
    "qwenimage": "QwenImagePipeline",
    "hunyuanvideo": "HunyuanVideoPipeline",
}


def tiny_pipeline(family: str, *, seed: int = 0):
    """A stock diffusers pipeline of `family` (see PIPELINES) with tiny random parts, seeded per component."""
    import diffusers

    if family not in PIPELINES:
        raise ValueError(f"unknown tiny pipeline family {family!r}; choose one of {', '.join(PIPELINES)}")
    with torch.random.fork_rng():  # leave the caller's global RNG alone
        t5_tok = t5_tokenizer()
        t5 = t5_encoder(seed + 1, len(t5_tok))
        if family.startswith("pixart"):  # learned sigma: out = 2 x 4 latent channels
            parts = dict(
                transformer=tiny_transformer("pixart", seed=seed),
                text_encoder=t5,
                tokenizer=t5_tok,
                vae=image_vae(seed + 2, 4, scaling_factor=0.18215),
                scheduler=diffusers.DPMSolverMultistepScheduler(),
            )
        elif family == "sd3":  # CLIP 16 + 16 wide = T5 32 = joint dim; pooled 16 + 16
            clip_tok, clip_tok_2 = clip_tokenizer(), clip_tokenizer()
            parts = dict(
                transformer=tiny_transformer("sd3", seed=seed),
                text_encoder=clip_encoder(seed + 3, len(clip_tok), TEXT_DIM // 2, projection=True),
                text_encoder_2=clip_encoder(seed + 4, len(clip_tok), TEXT_DIM // 2, projection=True),
                text_encoder_3=t5,
                tokenizer=clip_tok,
                tokenizer_2=clip_tok_2,
                tokenizer_3=t5_tok,
                vae=image_vae(
                    seed + 2,
                    16,
                    scaling_factor=1.5305,
                    shift_factor=0.0609,
                    use_quant_conv=False,
                    use_post_quant_conv=False,
                ),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
            )
        elif family == "flux":  # 2 x 2 patches of 16 latent channels packed into 64
            clip_tok = clip_tokenizer()
            parts = dict(
                transformer=tiny_transformer("flux", seed=seed, in_channels=64),
                text_encoder=clip_encoder(seed + 3, len(clip_tok), TEXT_DIM, projection=False),
                text_encoder_2=t5,
                tokenizer=clip_tok,
                tokenizer_2=t5_tok,
                vae=image_vae(
                    seed + 2,
                    16,
                    scaling_factor=0.3611,
                    shift_factor=0.1159,
                    use_quant_conv=False,
                    use_post_quant_conv=False,
                ),
                scheduler=_flux_scheduler(),
            )
        elif family == "flux2":  # Mistral 3's states after 3 layers stacked (3 x 32 wide); 2 x 2 x 4 packed into 16
            mistral_tok = mistral_tokenizer()
            parts = dict(
                transformer=tiny_transformer(
                    "flux2", seed=seed, joint_attention_dim=3 * TEXT_DIM, guidance_embeds=True
                ),
                text_encoder=mistral3_encoder(seed + 1, len(mistral_tok)),
                tokenizer=mistral_tok,
                vae=flux2_vae(seed + 2, 4),
                scheduler=_flux_scheduler(),
            )
        elif family == "wan":  # Wan 2.1's layout: one transformer, flow matching with shift
            parts = dict(
                transformer=tiny_transformer("wan", seed=seed),
                text_encoder=t5_encoder(seed + 1, len(t5_tok), umt5=True),
                tokenizer=t5_tok,
                vae=wan_vae(seed + 2, 4),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
            )
        elif family == "hunyuanvideo":  # Llama states (padded, masked) and CLIP's pooled embedding
            llama_tok, clip_tok = llama_tokenizer(), clip_tokenizer()
            parts = dict(
                transformer=tiny_transformer("hunyuanvideo", seed=seed),
                text_encoder=llama_encoder(seed + 1, len(llama_tok)),
                tokenizer=llama_tok,
                text_encoder_2=clip_encoder(seed + 3, len(clip_tok), TEXT_DIM, projection=False, positions=77),
                tokenizer_2=clip_tok,
                vae=hunyuan_vae(seed + 2, 4),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
            )
        elif family == "qwenimage":  # 2 x 2 patches of 4 latent channels packed into 16
            qwen_tok = qwen_tokenizer()
            parts = dict(
                transformer=tiny_transformer("qwenimage", seed=seed),
                text_encoder=qwen_vl_encoder(seed + 1, len(qwen_tok)),
                tokenizer=qwen_tok,
                vae=qwen_vae(seed + 2, 4),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
                    shift=1.0,
                    use_dynamic_shifting=True,
                    base_shift=0.5,
                    max_shift=0.9,
                    base_image_seq_len=256,
                    max_image_seq_len=8192,
                    time_shift_type="exponential",
                ),
            )
        else:  # cogvideox (2b's sampler: v-prediction, zero-SNR, trailing)
            parts = dict(
                transformer=tiny_transformer("cogvideox", seed=seed),
                text_encoder=t5,
                tokenizer=t5_tok,
                vae=video_vae(seed + 2),
                scheduler=diffusers.CogVideoXDDIMScheduler(
                    clip_sample=False,
                    prediction_type="v_prediction",
                    rescale_betas_zero_snr=True,
                    timestep_spacing="trailing",
                ),
            )
        return getattr(diffusers, PIPELINES[family])(**parts)


def _flux_scheduler():
    """Flux.1's and Flux.2's: flow matching with a shift that grows with the image's tokens."""
    import diffusers

    return diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def save_tiny_pipeline(family: str, path, *, seed: int = 0) -> Path:
    """Build `tiny_pipeline(family, seed=seed)` and save it as a diffusers folder (model_index.json + safetensors)."""
    path = Path(path)
    tiny_pipeline(family, seed=seed).save_pretrained(path, safe_serialization=True)
    return path


def _hunyuan_template() -> dict:
    prefix = HUNYUAN_TEMPLATE.split("{}")[0]
    return {"template": HUNYUAN_TEMPLATE, "crop_start": len(llama_tokenizer()(prefix).input_ids)}


def tiny_pipeline_kwargs(family: str) -> dict:
    """Call arguments that run a tiny pipeline at an 8 x 8 latent (CogVideoX: 9 frames -> 3 latent frames,
    Wan: 5 frames -> 2)."""
    size = dict(height=16, width=16, max_sequence_length=MAX_TOKENS)
    table = {
        "pixart": dict(size, use_resolution_binning=False, clean_caption=False),
        "pixart-sigma": dict(size, use_resolution_binning=False, clean_caption=False),
        "sd3": size,
        "flux": size,
        # the system message and the prompt are some 50 tokens: padded to 64 (the pipeline's default: 512)
        "flux2": dict(height=16, width=16, max_sequence_length=64),
        "cogvideox": dict(height=32, width=32, num_frames=9, max_sequence_length=MAX_TOKENS),
        "wan": dict(height=64, width=64, num_frames=5, max_sequence_length=MAX_TOKENS),  # 2 latent frames of 8 × 8
        # 8 × 8 latent: 4 × 4 tokens; the text as long as each prompt encodes, padded and masked in a batch
        "qwenimage": dict(height=32, width=32),
        "hunyuanvideo": dict(  # 2 latent frames of 8 × 8: 2 × 4 × 4 tokens; text padded to 8, masked
            height=64, width=64, num_frames=5, max_sequence_length=MAX_TOKENS, prompt_template=_hunyuan_template()
        ),
    }
    if family not in table:
        raise ValueError(f"unknown tiny pipeline family {family!r}; choose one of {', '.join(table)}")
    return dict(table[family])
