"""The parts of tiny pipelines: tokenizers, text encoders and VAEs with random weights, built locally.

Nothing can be downloaded: tokenizers are built from a word list (plus single characters, so any prompt
tokenizes) with transformers' own tokenizer classes, so a saved folder loads with stock
`DiffusionPipeline.from_pretrained` and the pipelines' type checks see the classes they expect. Each
part is seeded; a family's TINY names the parts of its pipeline (families/tiny_spec.Part), and
xdit_lab.tiny assembles them around the family's tiny transformer.
"""

from __future__ import annotations

import re
import string

import torch

from ..families.tiny_spec import MAX_TOKENS, TEXT_DIM

WORDS = (
    "a an the of and in on with photo picture drawing handwritten digit number cat dog bird car tree house "
    "red blue green black white yellow small big"
).split() + list(string.digits)

# HunyuanVideoPipeline's prompt template, shortened to the tiny tokenizer's special tokens: crop_start is the
# template's tokens before the prompt, which the pipeline crops off the Llama states
HUNYUAN_TEMPLATE = "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"


def hunyuan_prompt_template() -> dict:
    """HunyuanVideoPipeline's `prompt_template` for the tiny Llama tokenizer: the template, and how many of
    its tokens come before the prompt (crop_start, cropped off the Llama states)."""
    prefix = HUNYUAN_TEMPLATE.split("{}")[0]
    return {"template": HUNYUAN_TEMPLATE, "crop_start": len(llama_tokenizer()(prefix).input_ids)}


# HunyuanVideoImageToVideoPipeline's template, as short: the image's place (<image>, which Llava expands into the
# vision tower's tokens) in a system turn, the prompt in a user turn, then the assistant's header, whose four
# tokens (<|eot_id|>, <|start_header_id|>, assistant, <|end_header_id|>) the pipeline crops off
HUNYUAN_I2V_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\n<image>\nDescribe the video<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
)


def hunyuan_i2v_prompt_template() -> dict:
    """HunyuanVideoImageToVideoPipeline's `prompt_template` for the tiny Llava (llava_tokenizer, llava_encoder):
    crop_start (the template's tokens before the prompt, <image> one of them), and where the image's tokens lie
    once Llava has expanded <image> into the vision tower's LLAVA_IMAGE_TOKENS."""
    tokenizer = llava_tokenizer()
    prefix = tokenizer(HUNYUAN_I2V_TEMPLATE.split("{}")[0]).input_ids
    start = prefix.index(tokenizer.convert_tokens_to_ids("<image>"))
    return dict(
        template=HUNYUAN_I2V_TEMPLATE,
        crop_start=len(prefix),
        image_emb_start=start,
        image_emb_end=start + LLAVA_IMAGE_TOKENS,
        image_emb_len=LLAVA_IMAGE_TOKENS,
    )


def t5_tokenizer():
    """Unigram pieces "▁word" for WORDS and single characters as a fallback; "</s>" appended, "<pad>" = 0."""
    from transformers import T5Tokenizer

    chars = string.ascii_letters + string.digits + string.punctuation
    vocab = (
        [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
        + [("▁" + w, -1.0) for w in WORDS]
        + [(c, -5.0) for c in chars]
    )
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def clip_tokenizer():
    """Byte-level BPE over the 256 byte symbols, with merges that make each of WORDS one token (never <unk>,
    which is CLIP's end-of-text token and would move the pooled position)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    alphabet = sorted(ByteLevel.alphabet())
    base = ["<|startoftext|>", "<|endoftext|>"] + alphabet + [c + "</w>" for c in alphabet]
    vocab, merges = _bpe(base, [[*word[:-1], word[-1] + "</w>"] for word in WORDS])
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)


def _bpe(base: list[str], words: list[list[str]]) -> tuple[dict, list]:
    """A BPE vocabulary and merges: the `base` symbols, then merges left to right that make each of
    `words` (given as its symbols) one token."""
    tokens, merges = list(base), []
    for parts in words:
        while len(parts) > 1:
            merges.append((parts[0], parts[1]))
            parts = [parts[0] + parts[1]] + parts[2:]
            tokens.append(parts[0])
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}, list(dict.fromkeys(merges))


# the words of QwenImagePipeline's chat template, so that its system prompt is a few tokens, not bytes
QWEN_TEMPLATE_WORDS = (
    "system user assistant Describe image by detailing color shape size texture quantity text spatial "
    "relationships objects background"
).split()


def qwen_tokenizer(*, vision: bool = False):
    """Qwen2's byte-level BPE over the 256 byte symbols, with merges that make each of WORDS and the chat
    template's words one token (alone, or after a space: "Ġword"), and the template's special tokens. With
    `vision` (Qwen-Image-Edit's, whose template holds the image): the edit template's words too, and the vision
    tokens last, QWEN_VISION_TOKENS in that order (qwen_vl_encoder reads their ids from the vocabulary's end)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    template_words = QWEN_TEMPLATE_WORDS + (QWEN_EDIT_TEMPLATE_WORDS if vision else [])
    words = [list(prefix + w) for w in WORDS + template_words for prefix in ("Ġ", "")]
    vocab, merges = _bpe(["<|endoftext|>", *sorted(ByteLevel.alphabet())], words)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    specials = ["<|im_start|>", "<|im_end|>", *(QWEN_VISION_TOKENS if vision else ())]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


# the words of QwenImageEditPipeline's chat template, and Qwen2.5-VL's vision tokens (the image's place in it)
QWEN_EDIT_TEMPLATE_WORDS = (
    "the key features of input objects), then explain how user's instruction should alter or modify Generate a new "
    "that meets requirements while maintaining consistency original where appropriate Picture"
).split()
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def qwen_vl_tokenizer():
    """qwen_tokenizer with vision: the tokenizer of Qwen-Image-Edit's tiny pipelines."""
    return qwen_tokenizer(vision=True)


# Qwen3's chat as Flux2KleinPipeline renders it: the user's turn, then the assistant's header and, with
# enable_thinking=False, an empty thinking block (the real template's shape, its tool and system parts left out)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def qwen3_tokenizer():
    """qwen_tokenizer's, with Qwen3's thinking tokens and QWEN3_CHAT_TEMPLATE (Flux.2 klein's tokenizer)."""
    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


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


def qwen_vl_processor():
    """What Qwen-Image-Edit's pipelines hand the image and the prompt to: Qwen2.5-VL's image processor (the PIL
    one; images scaled to at most 56 × 56 pixels: 4 × 4 patches of 14, merged 2 × 2 into 4 tokens) and
    qwen_vl_tokenizer, in a Qwen2VLImageTextProcessor."""
    from transformers import Qwen2VLImageProcessorPil

    from .qwen_vl_processor import Qwen2VLImageTextProcessor

    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56)
    return Qwen2VLImageTextProcessor(image_processor=image_processor, tokenizer=qwen_vl_tokenizer())


# Qwen2.5's chat as HunyuanVideo15Pipeline renders it (apply_chat_template with add_generation_prompt): a system
# turn, the user's turn, then the assistant's header
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def qwen_chat_tokenizer():
    """Qwen2.5-VL's tokenizer as HunyuanVideo15Pipeline uses it: Qwen2's byte-level BPE (qwen_tokenizer's
    alphabet) with WORDS and the words of the pipeline's system message one token each (alone, or after a space),
    the chat's special tokens and QWEN_CHAT_TEMPLATE. The pipeline pads to 1000 tokens past its crop, on the right."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    words = [list(prefix + w) for w in dict.fromkeys(WORDS + re.findall(r"[A-Za-z]+", system)) for prefix in ("Ġ", "")]
    vocab, merges = _bpe(["<|endoftext|>", *sorted(ByteLevel.alphabet())], words)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


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


def byt5_tokenizer():
    """ByT5's tokenizer: bytes, three special tokens before them; it needs no files (HunyuanVideo-1.5's glyph text)."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def llama_tokenizer():
    """Llama's BPE over single characters (byte fallback), with merges that make each of WORDS after a
    space ("▁word") one token, HunyuanVideo's template special tokens, and padding on the right."""
    specials = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return _llama_bpe(WORDS, specials, padding_side="right")


def llava_tokenizer():
    """llama_tokenizer's, with the words of HUNYUAN_I2V_TEMPLATE one token each (the pipeline crops the assistant's
    header as four tokens) and Llava's <image> last: its id is the vocabulary's last (llava_encoder's)."""
    specials = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<image>"]
    bare = ("system", "user", "assistant", "Describe", "\n\n")
    return _llama_bpe(WORDS + ["video"], specials, bare=bare, padding_side="right")


def _llama_bpe(words: list[str], specials: list[str], bare: tuple[str, ...] = (), **kwargs):
    """transformers' LlamaTokenizer over single characters (byte fallback), with merges that make each of
    `words` after a space ("▁word") one token, each of `bare` one token where no space leads it, and `specials`
    as special tokens; "<unk>" pads."""
    from transformers import LlamaTokenizer

    chars = [*string.ascii_letters, *string.digits, *string.punctuation, " ", "\n", "▁"]
    base = ["<unk>", "<s>", "</s>", *[f"<0x{i:02X}>" for i in range(256)], *chars]
    vocab, merges = _bpe(base, [list("▁" + w) for w in dict.fromkeys(words)] + [list(w) for w in bare])
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, **kwargs)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.pad_token = "<unk>"
    return tokenizer


# Flux2Pipeline's chat, in Mistral's format: a system prompt, then the user's prompt (text parts only)
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if content is not string -%}"
    "{%- set content = content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}[SYSTEM_PROMPT]{{ content }}[/SYSTEM_PROMPT]"
    "{%- else -%}[INST]{{ content }}[/INST]{%- endif -%}"
    "{%- endfor -%}"
)


def mistral_tokenizer():
    """A Mistral-format tokenizer for Flux2Pipeline: Llama's character BPE with WORDS and the pipeline's
    system message one token per word, Mistral's chat special tokens, and MISTRAL_CHAT_TEMPLATE.

    The real pipeline's `tokenizer` is a PixtralProcessor; its image half needs torchvision, which this
    project does not install. For text prompts the processor's `apply_chat_template` renders the
    template and calls its tokenizer, the same call the pipeline makes here on the tokenizer itself."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    words = WORDS + re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)
    specials = ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]
    return _llama_bpe(words, specials, chat_template=MISTRAL_CHAT_TEMPLATE)


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


# the tiny CLIP vision tower's tokens per image, less its class token (Llava's "default" feature selection)
LLAVA_IMAGE_TOKENS = (32 // 8) ** 2


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


def clip_image_processor():
    """CLIP's image processor at the tiny vision tower's size: resized and center-cropped to 32 × 32."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


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


def siglip_image_processor():
    """SigLIP's image processor at the tiny vision tower's size (the PIL one: no torchvision), 32 × 32."""
    from transformers import SiglipImageProcessorPil

    return SiglipImageProcessorPil(size={"height": 32, "width": 32})


def gemma_tokenizer():
    """Gemma's BPE over single characters, with merges that make each of WORDS after a space ("▁word") one token;
    "<bos>" begins every text, "<pad>" = 0 pads (SanaPipeline pads on the right, to max_sequence_length)."""
    from transformers import GemmaTokenizer

    chars = [*string.ascii_letters, *string.digits, *string.punctuation, " ", "\n", "▁"]
    base = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *chars]
    vocab, merges = _bpe(base, [list("▁" + w) for w in dict.fromkeys(WORDS)])
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)


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
