"""Tiny tokenizers and input processors: what turns a prompt (or an image) into a tiny pipeline's model inputs.

Nothing can be downloaded: tokenizers are built from a word list (plus single characters, so any prompt
tokenizes) with transformers' own tokenizer classes, each with the chat template or prompt template its
pipeline renders, shortened; so a saved folder loads with stock `DiffusionPipeline.from_pretrained` and the
pipelines' type checks see the classes they expect. A family's TINY names its parts by builder
(families/tiny_spec.Part); xdit_lab.tiny finds the builder here, in encoders.py or in vaes.py.
"""

from __future__ import annotations

import inspect
import re
import string

from ..families.tiny_spec import MAX_TOKENS

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


# the tiny CLIP vision tower's tokens per image, less its class token (Llava's "default" feature selection)
LLAVA_IMAGE_TOKENS = (32 // 8) ** 2


def clip_image_processor():
    """CLIP's image processor at the tiny vision tower's size: resized and center-cropped to 32 × 32."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


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
