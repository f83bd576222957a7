"""The parts of the tiny digits pipeline, built from stock diffusers / transformers classes.

Everything here is a real diffusers or transformers object, so the saved folder loads with
`PixArtAlphaPipeline.from_pretrained` and nothing of xdit_lab is needed to run it.

    prompt "a handwritten 7"
      -> WordLevel tokenizer (16 words, "</s>" appended, padded to MAX_TOKENS)
      -> T5EncoderModel, 2 layers, width 32 (random, frozen: see train.py)
      -> PixArtTransformer2DModel, 4 layers, 4 heads x 32, patch 2 on a 4 x 16 x 16 latent
         (an 8 x 8 grid = 64 image tokens)
      -> AutoencoderKL with a single block: no downsampling, so one latent pixel per image pixel
      -> 16 x 16 RGB image (grey digits, white ink on black, like scikit-learn's data)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

DIGITS_DIR = Path(__file__).resolve().parent.parent / "assets" / "digits"  # the committed, trained pipeline
PIXELS = 16  # image side in pixels; the latent has the same side (the VAE does not downsample)
LATENT_CHANNELS = 4
MAX_TOKENS = 8  # "a handwritten 7" is 4 tokens with "</s>"; the rest is masked padding
WORDS = ["<pad>", "</s>", "<unk>", "a", "handwritten", "digit", "number", "of"] + [str(d) for d in range(10)]


def prompt_for(digit: int) -> str:
    """The caption the model was trained with for `digit` (0-9)."""
    return f"a handwritten {int(digit)}"


def load_digit_images(size: int = PIXELS) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1797 digits as `[N, 3, size, size]` images in [-1, 1] and their labels.

    The data set is 8 x 8 with values 0-16 (16 = ink). Bilinear upsampling gives smooth strokes
    instead of 2 x 2 blocks; averaging 2 x 2 pixels (what the classifier does) nearly undoes it.
    Grey is repeated over three channels because the pipeline's image processor expects RGB.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0  # [N, 1, 8, 8] in [0, 1]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x * 2 - 1).clamp(-1, 1).repeat(1, 3, 1, 1)
    return x, torch.tensor(data.target, dtype=torch.long)


def build_tokenizer():
    """A word-level tokenizer that appends "</s>" like T5's, so "" (the null caption) is one token."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=MAX_TOKENS
    )


def build_text_encoder(seed: int):
    """The tiny pipelines' T5 encoder (xdit_lab.tiny.encoders), 32 wide over WORDS, frozen: the trainer
    trains the transformer and the VAE, never the text encoder."""
    from ..tiny.encoders import t5_encoder

    return t5_encoder(seed, len(WORDS), width=32).requires_grad_(False)


def build_vae(seed: int):
    """One encoder block and one decoder block: 16 x 16 pixels <-> 4 x 16 x 16 latent.

    With a single block diffusers' `vae_scale_factor` is 2**0 = 1, so the pipeline asks for a
    latent as large as the image. That keeps 64 tokens (patch 2) at 16 px, where an SD-style
    8x VAE would leave a 2 x 2 latent. No mid-block attention: at this size convolutions see
    the whole digit anyway.
    """
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(32,),
        layers_per_block=1,
        norm_num_groups=8,
        latent_channels=LATENT_CHANNELS,
        sample_size=PIXELS,
        mid_block_add_attention=False,
    )


def build_transformer(seed: int, caption_channels: int):
    """PixArt-alpha's transformer at toy size: 4 layers, 4 heads x 32, 64 image tokens.

    out_channels = in_channels: no learned variance (PixArt's pipeline then uses all channels).
    """
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    return PixArtTransformer2DModel(
        num_attention_heads=4,
        attention_head_dim=32,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=4,
        cross_attention_dim=128,
        caption_channels=caption_channels,
        sample_size=PIXELS,
        patch_size=2,
        norm_type="ada_norm_single",
        use_additional_conditions=False,
    )


def as_numpy_images(images) -> np.ndarray:
    """PIL image(s), numpy or torch -> float `[N, H, W]` grey in [0, 1].

    Accepts `[N, H, W, C]` / `[H, W, C]` numpy (the pipeline's "np" output, [0, 1]), `[N, C, H, W]`
    torch (its "pt" output, [0, 1], or the raw VAE range [-1, 1]: any negative value means [-1, 1]),
    and lists of PIL images.
    """
    if isinstance(images, (list, tuple)):
        return np.concatenate([as_numpy_images(im) for im in images])
    if hasattr(images, "convert"):  # a PIL image
        return np.asarray(images.convert("L"), dtype=np.float32)[None] / 255.0
    if isinstance(images, torch.Tensor):
        x = images.detach().float().cpu()
        x = x[None] if x.ndim == 3 else x
        x = x.mean(1) if x.ndim == 4 else x  # [N, C, H, W] -> grey
        x = x.numpy()
    else:
        raw = np.asarray(images)
        x = raw.astype(np.float32) / (255.0 if raw.dtype == np.uint8 else 1.0)
        x = x[None] if x.ndim == 2 or (x.ndim == 3 and x.shape[-1] in (1, 3, 4)) else x
        x = x[..., :3].mean(-1) if x.ndim == 4 else x  # [N, H, W, C] -> grey
    if x.min() < 0:
        x = (x + 1) / 2
    return np.clip(x, 0.0, 1.0).astype(np.float32)
