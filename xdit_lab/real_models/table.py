"""The seven real models as published (/work/shared/REAL-MODELS.md): per component its class, the
library it lives in, its constructor (or configuration) arguments and the dtype its weights are
stored in; per model its pipeline class and the components model_index.json lists but that hold no
weights here (tokenizers)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Component:
    """One component of a pipeline folder: its class, where the class lives, how it is built and the
    dtype its weights are stored in. For transformers classes, `kwargs` build `config_class`."""

    library: str  # "diffusers" or "transformers"
    class_name: str
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype | None = None  # stored dtype of floating tensors; None: no weights (a scheduler)
    config_class: str | None = None  # transformers: the configuration class the kwargs build


@dataclass(frozen=True)
class RealModel:
    name: str
    pipeline_class: str
    components: dict[str, Component]  # written: configs (and weights, for models)
    listed_only: dict[str, tuple[str, str]] = field(default_factory=dict)  # in model_index.json, not written


# ---- the published configurations (REAL-MODELS.md) -----------------------------------------------------------

T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_decoder_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
)
UMT5_XXL = dict(T5_XXL, vocab_size=256384, scalable_attention=True)
CLIP_L = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=768,
)
CLIP_BIG_G = dict(
    CLIP_L, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20, hidden_act="gelu"
)
CLIP_BIG_G["projection_dim"] = 1280
LLAMA_HUNYUAN = dict(
    vocab_size=128320,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
)
QWEN_2_5_VL_7B = dict(  # Qwen2.5-VL-7B-Instruct's published config.json
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    tie_word_embeddings=False,
    vision_config=dict(
        depth=32,
        hidden_act="silu",
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        in_chans=3,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        spatial_patch_size=14,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        tokens_per_second=2,
        temporal_patch_size=2,
    ),
)
IMAGE_VAE_16 = dict(  # FLUX.1 and SD3.5
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    norm_num_groups=32,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
)
IMAGE_VAE_4 = dict(  # SD-style (PixArt)
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    norm_num_groups=32,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    sample_size=512,
    scaling_factor=0.13025,
)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _diffusers(class_name, dtype, **kwargs) -> Component:
    return Component("diffusers", class_name, kwargs, dtype)


def _transformers(class_name, config_class, dtype, kwargs) -> Component:
    return Component("transformers", class_name, dict(kwargs), dtype, config_class)


def _scheduler(class_name, **kwargs) -> Component:
    return Component("diffusers", class_name, kwargs, None)


REAL_MODELS = {
    model.name: model
    for model in (
        RealModel(
            "FLUX.1-dev",
            "FluxPipeline",
            dict(
                transformer=_diffusers(
                    "FluxTransformer2DModel",
                    BF16,
                    patch_size=1,
                    in_channels=64,
                    num_layers=19,
                    num_single_layers=38,
                    attention_head_dim=128,
                    num_attention_heads=24,
                    joint_attention_dim=4096,
                    pooled_projection_dim=768,
                    guidance_embeds=True,
                    axes_dims_rope=(16, 56, 56),
                ),
                text_encoder=_transformers("CLIPTextModel", "CLIPTextConfig", BF16, CLIP_L),
                text_encoder_2=_transformers("T5EncoderModel", "T5Config", BF16, T5_XXL),
                vae=_diffusers("AutoencoderKL", BF16, **IMAGE_VAE_16, scaling_factor=0.3611, shift_factor=0.1159),
                scheduler=_scheduler(
                    "FlowMatchEulerDiscreteScheduler",
                    shift=3.0,
                    use_dynamic_shifting=True,
                    base_shift=0.5,
                    max_shift=1.15,
                    base_image_seq_len=256,
                    max_image_seq_len=4096,
                ),
            ),
            dict(tokenizer=("transformers", "CLIPTokenizer"), tokenizer_2=("transformers", "T5TokenizerFast")),
        ),
        RealModel(
            "SD3.5-large",
            "StableDiffusion3Pipeline",
            dict(
                transformer=_diffusers(
                    "SD3Transformer2DModel",
                    BF16,
                    sample_size=128,
                    patch_size=2,
                    in_channels=16,
                    num_layers=38,
                    attention_head_dim=64,
                    num_attention_heads=38,
                    joint_attention_dim=4096,
                    caption_projection_dim=2432,
                    pooled_projection_dim=2048,
                    out_channels=16,
                    pos_embed_max_size=192,
                    qk_norm="rms_norm",
                ),
                text_encoder=_transformers("CLIPTextModelWithProjection", "CLIPTextConfig", BF16, CLIP_L),
                text_encoder_2=_transformers("CLIPTextModelWithProjection", "CLIPTextConfig", BF16, CLIP_BIG_G),
                text_encoder_3=_transformers("T5EncoderModel", "T5Config", BF16, T5_XXL),
                vae=_diffusers("AutoencoderKL", BF16, **IMAGE_VAE_16, scaling_factor=1.5305, shift_factor=0.0609),
                scheduler=_scheduler("FlowMatchEulerDiscreteScheduler", shift=3.0),
            ),
            dict(
                tokenizer=("transformers", "CLIPTokenizer"),
                tokenizer_2=("transformers", "CLIPTokenizer"),
                tokenizer_3=("transformers", "T5TokenizerFast"),
            ),
        ),
        RealModel(
            "PixArt-Σ-XL-2-1024-MS",
            "PixArtSigmaPipeline",
            dict(
                transformer=_diffusers(
                    "PixArtTransformer2DModel",
                    F32,
                    num_attention_heads=16,
                    attention_head_dim=72,
                    in_channels=4,
                    out_channels=8,
                    num_layers=28,
                    norm_num_groups=32,
                    cross_attention_dim=1152,
                    attention_bias=True,
                    sample_size=128,
                    patch_size=2,
                    activation_fn="gelu-approximate",
                    num_embeds_ada_norm=1000,
                    upcast_attention=False,
                    norm_type="ada_norm_single",
                    norm_elementwise_affine=False,
                    norm_eps=1e-6,
                    interpolation_scale=2,
                    use_additional_conditions=False,
                    caption_channels=4096,
                    attention_type="default",
                ),
                text_encoder=_transformers("T5EncoderModel", "T5Config", F32, T5_XXL),
                vae=_diffusers("AutoencoderKL", F32, **IMAGE_VAE_4),
                scheduler=_scheduler("DPMSolverMultistepScheduler"),
            ),
            dict(tokenizer=("transformers", "T5Tokenizer")),
        ),
        RealModel(
            "CogVideoX-5b",
            "CogVideoXPipeline",
            dict(
                transformer=_diffusers(
                    "CogVideoXTransformer3DModel",
                    BF16,
                    num_attention_heads=48,
                    attention_head_dim=64,
                    in_channels=16,
                    out_channels=16,
                    flip_sin_to_cos=True,
                    freq_shift=0,
                    time_embed_dim=512,
                    text_embed_dim=4096,
                    num_layers=42,
                    attention_bias=True,
                    sample_width=90,
                    sample_height=60,
                    sample_frames=49,
                    patch_size=2,
                    temporal_compression_ratio=4,
                    max_text_seq_length=226,
                    activation_fn="gelu-approximate",
                    timestep_activation_fn="silu",
                    norm_elementwise_affine=True,
                    norm_eps=1e-5,
                    spatial_interpolation_scale=1.875,
                    temporal_interpolation_scale=1.0,
                    use_rotary_positional_embeddings=True,
                    use_learned_positional_embeddings=False,
                ),
                text_encoder=_transformers("T5EncoderModel", "T5Config", BF16, T5_XXL),
                vae=_diffusers(
                    "AutoencoderKLCogVideoX",
                    BF16,
                    latent_channels=16,
                    block_out_channels=(128, 256, 256, 512),
                    layers_per_block=3,
                    temporal_compression_ratio=4,
                    scaling_factor=0.7,
                ),
                scheduler=_scheduler(
                    "CogVideoXDDIMScheduler",
                    clip_sample=False,
                    prediction_type="v_prediction",
                    rescale_betas_zero_snr=True,
                    timestep_spacing="trailing",
                    snr_shift_scale=1.0,
                ),
            ),
            dict(tokenizer=("transformers", "T5Tokenizer")),
        ),
        RealModel(
            "Wan2.1-T2V-14B",
            "WanPipeline",
            dict(
                transformer=_diffusers(
                    "WanTransformer3DModel",
                    BF16,
                    patch_size=(1, 2, 2),
                    num_attention_heads=40,
                    attention_head_dim=128,
                    in_channels=16,
                    out_channels=16,
                    text_dim=4096,
                    freq_dim=256,
                    ffn_dim=13824,
                    num_layers=40,
                    cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads",
                    eps=1e-6,
                    rope_max_seq_len=1024,
                ),
                text_encoder=_transformers("UMT5EncoderModel", "UMT5Config", F32, UMT5_XXL),
                vae=_diffusers("AutoencoderKLWan", F32),
                scheduler=_scheduler(
                    "UniPCMultistepScheduler", prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
                ),
            ),
            dict(tokenizer=("transformers", "T5TokenizerFast")),
        ),
        RealModel(
            "HunyuanVideo",
            "HunyuanVideoPipeline",
            dict(
                transformer=_diffusers(
                    "HunyuanVideoTransformer3DModel",
                    BF16,
                    in_channels=16,
                    out_channels=16,
                    num_attention_heads=24,
                    attention_head_dim=128,
                    num_layers=20,
                    num_single_layers=40,
                    num_refiner_layers=2,
                    mlp_ratio=4.0,
                    patch_size=2,
                    patch_size_t=1,
                    qk_norm="rms_norm",
                    guidance_embeds=True,
                    text_embed_dim=4096,
                    pooled_projection_dim=768,
                    rope_theta=256.0,
                    rope_axes_dim=(16, 56, 56),
                ),
                text_encoder=_transformers("LlamaModel", "LlamaConfig", F16, LLAMA_HUNYUAN),
                text_encoder_2=_transformers("CLIPTextModel", "CLIPTextConfig", F16, CLIP_L),
                vae=_diffusers("AutoencoderKLHunyuanVideo", F16),
                scheduler=_scheduler("FlowMatchEulerDiscreteScheduler", shift=7.0),
            ),
            dict(tokenizer=("transformers", "LlamaTokenizerFast"), tokenizer_2=("transformers", "CLIPTokenizer")),
        ),
        RealModel(
            "Qwen-Image",
            "QwenImagePipeline",
            dict(
                transformer=_diffusers(
                    "QwenImageTransformer2DModel",
                    BF16,
                    patch_size=2,
                    in_channels=64,
                    out_channels=16,
                    num_layers=60,
                    attention_head_dim=128,
                    num_attention_heads=24,
                    joint_attention_dim=3584,
                    guidance_embeds=False,
                    axes_dims_rope=(16, 56, 56),
                ),
                text_encoder=_transformers(
                    "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", BF16, QWEN_2_5_VL_7B
                ),
                vae=_diffusers("AutoencoderKLQwenImage", BF16),
                scheduler=_scheduler(
                    "FlowMatchEulerDiscreteScheduler",
                    shift=1.0,
                    use_dynamic_shifting=True,
                    base_shift=0.5,
                    max_shift=0.9,
                    base_image_seq_len=256,
                    max_image_seq_len=8192,
                    time_shift_type="exponential",
                ),
            ),
            dict(tokenizer=("transformers", "Qwen2Tokenizer")),
        ),
    )
}
