"""Tiny text and vision encoders with random weights (seeded), built from transformers' (and diffusers') own
configuration classes, at the widths the families' tiny transformers read (families/tiny_spec.TEXT_DIM).
A family's TINY names its parts by builder (families/tiny_spec.Part); xdit_lab.tiny finds the builder here,
in tokenizers.py or in vaes.py.
"""

from __future__ import annotations

import torch

from ..families.tiny_spec import MAX_TOKENS, TEXT_DIM
from .tokenizers import LLAVA_IMAGE_TOKENS


def qwen3_causal_encoder(seed: int, vocab_size: int):
    """Qwen3ForCausalLM (Flux.2 klein's text encoder), TEXT_DIM wide and 27 layers deep: Flux2KleinPipeline
    stacks the states after layers 9, 18 and 27 by default."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = decoder_text(vocab_size, 27, intermediate_size=TEXT_DIM, max_position_embeddings=512, head_dim=16)
    return Qwen3ForCausalLM(Qwen3Config(**config, tie_word_embeddings=True)).eval()


def qwen3_encoder(seed: int, vocab_size: int):
    """Qwen3's decoder, two layers TEXT_DIM wide (ZImagePipeline reads the states before the last layer's)."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    config = Qwen3Config(**decoder_text(vocab_size, 2, intermediate_size=TEXT_DIM, head_dim=16))
    return Qwen3Model(config).eval()


# the special tokens of the Llama-format tokenizers (_llama_bpe): "<unk>" pads, "<s>" begins, "</s>" ends
LLAMA_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def decoder_text(vocab_size: int, layers: int, **settings) -> dict:
    """The settings of a decoder-only text model TEXT_DIM wide with two attention heads and two key/value
    heads (Qwen2.5-VL's text, Mistral 3's, Llama), `layers` deep, beside the model's own `settings`."""
    sizes = dict(hidden_size=TEXT_DIM, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2)
    return dict(vocab_size=vocab_size, **sizes, **settings)


def qwen_vl_encoder(seed: int, vocab_size: int, *, vision: bool = False):
    """Qwen2.5-VL, text and a one-layer vision tower, TEXT_DIM wide (what QwenImagePipeline encodes with). With
    `vision` (qwen_tokenizer(vision=True)'s vocabulary), the vision tokens' ids are the vocabulary's last four,
    so that the image's embeddings take the places of <|image_pad|> and its rotary positions start at
    <|vision_start|> (Qwen-Image-Edit's pipelines feed it the image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    rope = {"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"}  # 8 = head_dim 16 / 2
    text = decoder_text(
        vocab_size, 2, intermediate_size=TEXT_DIM, rope_scaling=rope, rope_theta=1e6, bos_token_id=0, eos_token_id=0
    )
    vision_tower = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_DIM)
    ids = dict(vision_start_token_id=vocab_size - 1)
    if vision:
        names = ("vision_start", "vision_end", "image", "video")
        ids = {f"{name}_token_id": vocab_size - 4 + i for i, name in enumerate(names)}
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision_tower,
        hidden_size=TEXT_DIM,
        vocab_size=vocab_size,
        bos_token_id=0,
        eos_token_id=0,
        **ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_vl_text_encoder(seed: int, vocab_size: int):
    """Qwen2.5-VL's text model alone (HunyuanVideo15Pipeline's text encoder), TEXT_DIM wide and three layers deep:
    the pipeline reads the states before the last two layers."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(seed)
    rope = {"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"}  # 8 = head_dim 16 / 2
    config = decoder_text(
        vocab_size, 3, intermediate_size=TEXT_DIM, rope_scaling=rope, rope_theta=1e6, bos_token_id=0, eos_token_id=0
    )
    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**config)).eval()


def mistral3_encoder(seed: int, vocab_size: int):
    """Mistral 3 (Flux.2's text encoder), TEXT_DIM wide with a one-layer Pixtral vision tower, and 30
    text layers: Flux2Pipeline stacks the states after layers 10, 20 and 30 by default."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    text = decoder_text(vocab_size, 30, intermediate_size=TEXT_DIM, max_position_embeddings=512, **LLAMA_IDS)
    text |= dict(model_type="mistral", head_dim=TEXT_DIM // 2)
    vision = dict(
        model_type="pixtral", hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        head_dim=8, image_size=32, patch_size=8,
    )  # fmt: skip
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=vocab_size - 1)
    return Mistral3ForConditionalGeneration(config).eval()


def llama_encoder(seed: int, vocab_size: int):
    """LlamaModel, TEXT_DIM wide, four layers (the pipeline reads the states two layers before the last)."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(
        **decoder_text(vocab_size, 4, intermediate_size=2 * TEXT_DIM, max_position_embeddings=64, **LLAMA_IDS)
    )
    return LlamaModel(config).eval()


def llava_encoder(seed: int, vocab_size: int):
    """Llava (HunyuanVideo image to video's text encoder): the tiny CLIP vision tower (clip_vision_encoder's
    32 × 32 images in 8 × 8 patches) projected into a Llama TEXT_DIM wide and four layers deep (the pipeline reads
    the states two layers before the last), <image> the vocabulary's last token (llava_tokenizer's)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    text = decoder_text(vocab_size, 4, intermediate_size=2 * TEXT_DIM, max_position_embeddings=128, **LLAMA_IDS)
    vision = clip_vision_encoder(seed).config.to_dict()
    config = LlavaConfig(
        text_config=dict(text, model_type="llama"),
        vision_config=vision,
        image_token_index=vocab_size - 1,
        pad_token_id=LLAMA_IDS["pad_token_id"],
        image_seq_length=LLAVA_IMAGE_TOKENS,
    )
    return LlavaForConditionalGeneration(config).eval()


def t5_encoder(seed: int, vocab_size: int, width: int = TEXT_DIM, *, umt5: bool = False):
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


def clip_encoder(seed: int, vocab_size: int, width: int, projection: bool, positions: int = MAX_TOKENS):
    """CLIP text model; eos id 1 (not 2, which would select the legacy argmax pooling). positions: the
    longest input (HunyuanVideoPipeline pads CLIP's to 77 whatever the tokenizer says)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        projection_dim=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config).eval()


def clip_vision_encoder(seed: int, width: int = TEXT_DIM):
    """CLIP's vision tower (Wan 2.1's image encoder, whose pipeline reads its second-to-last hidden states):
    32 × 32 images in 8 × 8 patches, 17 tokens with the class token."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        projection_dim=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    return CLIPVisionModel(config).eval()


def siglip_vision_encoder(seed: int, width: int = 16):
    """SigLIP's vision tower (HunyuanVideo-1.5 image to video's image encoder, whose last states are the image's
    embeddings): 32 × 32 images in 8 × 8 patches, 16 tokens `width` wide."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    config = SiglipVisionConfig(
        hidden_size=width, intermediate_size=width, num_hidden_layers=1, num_attention_heads=2, image_size=32,
        patch_size=8,
    )  # fmt: skip
    return SiglipVisionModel(config).eval()


def gemma2_encoder(seed: int, vocab_size: int):
    """Gemma 2 (Sana's text encoder, whose last hidden states the pipeline reads), TEXT_DIM wide, two layers,
    two query heads sharing one key/value head, as Gemma 2's grouped heads do."""
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    config = Gemma2Config(
        vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=2 * TEXT_DIM, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return Gemma2Model(config).eval()


def gemma3_encoder(seed: int, vocab_size: int):
    """Gemma 3 (LTX-2's text encoder, every layer's hidden states of which its pipeline stacks), TEXT_DIM wide, two
    layers, two query heads sharing one key/value head; the vision tower it carries, at its smallest (unused)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(seed)
    text = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=2 * TEXT_DIM, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512, sliding_window=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    return Gemma3ForConditionalGeneration(config).eval()


def ltx2_connectors(seed: int):
    """LTX-2's text connectors: Gemma 3's stacked layers (two and the embeddings) projected, then one connector
    block each for the video's text and the audio's, without learnable registers."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    torch.manual_seed(seed)
    connector = dict(num_attention_heads=4, attention_head_dim=8, num_layers=1, num_learnable_registers=None)
    return LTX2TextConnectors(
        caption_channels=TEXT_DIM, text_proj_in_factor=3, connector_rope_base_seq_len=32, rope_type="split",
        **{f"{stream}_connector_{key}": value for stream in ("video", "audio") for key, value in connector.items()},
    ).eval()  # fmt: skip
