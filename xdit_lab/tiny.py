"""Tiny diffusers pipelines with random weights, for tests, benchmarks and tutorials.

`save_tiny_pipeline(family, path)` builds a whole stock diffusers pipeline around a tiny transformer
(tiny_models.py: every family at a size that runs in milliseconds on a CPU; `tiny_transformer` and
`tiny_inputs` are importable from here too) with text encoders, local tokenizers, VAE and scheduler,
all random and seeded, and saves it as an ordinary diffusers folder; `tiny_pipeline_kwargs(family)`
are the call arguments that run it in well under a second on a CPU.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from .tiny_models import HEAD_DIM, HEADS, TEXT_DIM, tiny_inputs, tiny_transformer

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

# ---- whole pipelines -------------------------------------------------------------------------------------------
# Nothing can be downloaded: tokenizers are built from a word list (plus single characters, so any prompt
# tokenizes) with transformers' own T5Tokenizer / CLIPTokenizer classes, so the saved folder loads with stock
# `DiffusionPipeline.from_pretrained` and the pipelines' type checks see the classes they expect.

WORDS = (
    "a an the of and in on with photo picture drawing handwritten digit number cat dog bird car tree house "
    "red blue green black white yellow small big"
).split() + list(string.digits)
MAX_TOKENS = 8  # CLIP's model_max_length, and `max_sequence_length` for T5 (CogVideoX needs text length = 8)
PIPELINES = {
    "pixart": "PixArtAlphaPipeline",
    "pixart-sigma": "PixArtSigmaPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "cogvideox": "CogVideoXPipeline",
    "wan": "WanPipeline",
    "qwenimage": "QwenImagePipeline",
}


def _t5_tokenizer():
    """Unigram pieces "▁word" for WORDS and single characters as a fallback; "</s>" appended, "<pad>" = 0."""
    from transformers import T5Tokenizer

    chars = string.ascii_letters + string.digits + string.punctuation
    vocab = (
        [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
        + [("▁" + w, -1.0) for w in WORDS]
        + [(c, -5.0) for c in chars]
    )
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def _clip_tokenizer():
    """Byte-level BPE over the 256 byte symbols, with merges that make each of WORDS one token (never <unk>,
    which is CLIP's end-of-text token and would move the pooled position)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    alphabet = sorted(ByteLevel.alphabet())
    tokens, merges = ["<|startoftext|>", "<|endoftext|>"] + alphabet + [c + "</w>" for c in alphabet], []
    for word in WORDS:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            merges.append((parts[0], parts[1]))
            parts = [parts[0] + parts[1]] + parts[2:]
            tokens.append(parts[0])
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=list(dict.fromkeys(merges)), model_max_length=MAX_TOKENS)


# the words of QwenImagePipeline's chat template, so that its system prompt is a few tokens, not bytes
QWEN_TEMPLATE_WORDS = (
    "system user assistant Describe image by detailing color shape size texture quantity text spatial "
    "relationships objects background"
).split()


def _qwen_tokenizer():
    """Qwen2's byte-level BPE over the 256 byte symbols, with merges that make each of WORDS and the chat
    template's words one token (alone, or after a space: "Ġword"), and the template's special tokens."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    tokens, merges = ["<|endoftext|>", *sorted(ByteLevel.alphabet())], []
    for word in [prefix + w for w in WORDS + QWEN_TEMPLATE_WORDS for prefix in ("Ġ", "")]:
        parts = list(word)
        while len(parts) > 1:
            merges.append((parts[0], parts[1]))
            parts = [parts[0] + parts[1]] + parts[2:]
            tokens.append(parts[0])
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=list(dict.fromkeys(merges)))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


def _qwen_vl_encoder(seed: int, vocab_size: int):
    """Qwen2.5-VL, text and a one-layer vision tower, TEXT_DIM wide (what QwenImagePipeline encodes with)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    rope = {"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"}  # 8 = head_dim 16 / 2
    text = dict(
        hidden_size=TEXT_DIM,
        intermediate_size=TEXT_DIM,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        rope_scaling=rope,
        rope_theta=1e6,
        bos_token_id=0,
        eos_token_id=0,
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_DIM)
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        hidden_size=TEXT_DIM,
        vocab_size=vocab_size,
        vision_start_token_id=vocab_size - 1,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _t5_encoder(seed: int, vocab_size: int, width: int = TEXT_DIM, *, umt5: bool = False):
    """T5's encoder, or UMT5's (Wan's text encoder: T5 with per-layer relative position biases)."""
    import transformers

    torch.manual_seed(seed)
    prefix = "UMT5" if umt5 else "T5"
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=vocab_size,
        d_model=width,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        d_ff=2 * width,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return getattr(transformers, f"{prefix}EncoderModel")(config).eval()


def _clip_encoder(seed: int, vocab_size: int, width: int, projection: bool):
    """CLIP text model; eos id 1 (not 2, which would select the legacy argmax pooling)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        projection_dim=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=MAX_TOKENS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def _vae(seed: int, latent_channels: int, **config):
    """Two blocks: one 2x downsampling (vae_scale_factor 2)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=latent_channels,
        sample_size=16,
        **config,
    ).eval()


def _video_vae(seed: int):
    """Three blocks: 4x spatial and (first two blocks) 4x temporal compression, like CogVideoX's 8x / 4x."""
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(seed)
    return AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3,
        block_out_channels=(8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
        sample_height=32,
        sample_width=32,
    ).eval()


def _qwen_vae(seed: int, latent_channels: int):
    """Qwen-Image's VAE (Wan's causal 3D VAE, one frame at a time) at its smallest: 4x spatial."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=latent_channels,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels,
    ).eval()


def _wan_vae(seed: int, latent_channels: int):
    """Wan's 3D causal VAE at its smallest: 8x spatial, 4x temporal compression, as Wan 2.1's."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=4,
        z_dim=latent_channels,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels,
    ).eval()


def tiny_pipeline(family: str, *, seed: int = 0):
    """A stock diffusers pipeline of `family` (see PIPELINES) with tiny random parts, seeded per component."""
    import diffusers

    if family not in PIPELINES:
        raise ValueError(f"unknown tiny pipeline family {family!r}; choose one of {', '.join(PIPELINES)}")
    with torch.random.fork_rng():  # leave the caller's global RNG alone
        t5_tok = _t5_tokenizer()
        t5 = _t5_encoder(seed + 1, len(t5_tok))
        if family.startswith("pixart"):  # learned sigma: out = 2 x 4 latent channels
            parts = dict(
                transformer=tiny_transformer("pixart", seed=seed),
                text_encoder=t5,
                tokenizer=t5_tok,
                vae=_vae(seed + 2, 4, scaling_factor=0.18215),
                scheduler=diffusers.DPMSolverMultistepScheduler(),
            )
        elif family == "sd3":  # CLIP 16 + 16 wide = T5 32 = joint dim; pooled 16 + 16
            clip_tok, clip_tok_2 = _clip_tokenizer(), _clip_tokenizer()
            parts = dict(
                transformer=tiny_transformer("sd3", seed=seed),
                text_encoder=_clip_encoder(seed + 3, len(clip_tok), TEXT_DIM // 2, projection=True),
                text_encoder_2=_clip_encoder(seed + 4, len(clip_tok), TEXT_DIM // 2, projection=True),
                text_encoder_3=t5,
                tokenizer=clip_tok,
                tokenizer_2=clip_tok_2,
                tokenizer_3=t5_tok,
                vae=_vae(
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
            clip_tok = _clip_tokenizer()
            parts = dict(
                transformer=tiny_transformer("flux", seed=seed, in_channels=64),
                text_encoder=_clip_encoder(seed + 3, len(clip_tok), TEXT_DIM, projection=False),
                text_encoder_2=t5,
                tokenizer=clip_tok,
                tokenizer_2=t5_tok,
                vae=_vae(
                    seed + 2,
                    16,
                    scaling_factor=0.3611,
                    shift_factor=0.1159,
                    use_quant_conv=False,
                    use_post_quant_conv=False,
                ),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
                    shift=3.0,
                    use_dynamic_shifting=True,
                    base_shift=0.5,
                    max_shift=1.15,
                    base_image_seq_len=256,
                    max_image_seq_len=4096,
                ),
            )
        elif family == "wan":  # Wan 2.1's layout: one transformer, flow matching with shift
            parts = dict(
                transformer=tiny_transformer("wan", seed=seed),
                text_encoder=_t5_encoder(seed + 1, len(t5_tok), umt5=True),
                tokenizer=t5_tok,
                vae=_wan_vae(seed + 2, 4),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
            )
        elif family == "qwenimage":  # 2 x 2 patches of 4 latent channels packed into 16
            qwen_tok = _qwen_tokenizer()
            parts = dict(
                transformer=tiny_transformer("qwenimage", seed=seed),
                text_encoder=_qwen_vl_encoder(seed + 1, len(qwen_tok)),
                tokenizer=qwen_tok,
                vae=_qwen_vae(seed + 2, 4),
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
                vae=_video_vae(seed + 2),
                scheduler=diffusers.CogVideoXDDIMScheduler(
                    clip_sample=False,
                    prediction_type="v_prediction",
                    rescale_betas_zero_snr=True,
                    timestep_spacing="trailing",
                ),
            )
        return getattr(diffusers, PIPELINES[family])(**parts)


def save_tiny_pipeline(family: str, path, *, seed: int = 0) -> Path:
    """Build `tiny_pipeline(family, seed=seed)` and save it as a diffusers folder (model_index.json + safetensors)."""
    path = Path(path)
    tiny_pipeline(family, seed=seed).save_pretrained(path, safe_serialization=True)
    return path


def tiny_pipeline_kwargs(family: str) -> dict:
    """Call arguments that run a tiny pipeline at an 8 x 8 latent (CogVideoX: 9 frames -> 3 latent frames,
    Wan: 5 frames -> 2)."""
    size = dict(height=16, width=16, max_sequence_length=MAX_TOKENS)
    table = {
        "pixart": dict(size, use_resolution_binning=False, clean_caption=False),
        "pixart-sigma": dict(size, use_resolution_binning=False, clean_caption=False),
        "sd3": size,
        "flux": size,
        "cogvideox": dict(height=32, width=32, num_frames=9, max_sequence_length=MAX_TOKENS),
        "wan": dict(height=64, width=64, num_frames=5, max_sequence_length=MAX_TOKENS),  # 2 latent frames of 8 × 8
        # 8 × 8 latent: 4 × 4 tokens; the text as long as each prompt encodes, padded and masked in a batch
        "qwenimage": dict(height=32, width=32),
    }
    if family not in table:
        raise ValueError(f"unknown tiny pipeline family {family!r}; choose one of {', '.join(table)}")
    return dict(table[family])
