"""Tiny stock diffusers pipelines built from scratch: each saves as a diffusers folder, reloads with
`DiffusionPipeline.from_pretrained` as the right class, and runs deterministically at a tiny size."""

import json

import numpy as np
import pytest
import torch

from xdit_lab.tiny import MAX_TOKENS, PIPELINES, save_tiny_pipeline, tiny_pipeline_kwargs

# (family, pipeline class): (latent shape for 2 prompts, decoded "np" shape); the family's default class first
EXPECTED = {
    ("pixart", "PixArtAlphaPipeline"): ((2, 4, 8, 8), (2, 16, 16, 3)),
    ("pixart", "PixArtSigmaPipeline"): ((2, 4, 8, 8), (2, 16, 16, 3)),
    ("sd3", "StableDiffusion3Pipeline"): ((2, 16, 8, 8), (2, 16, 16, 3)),
    ("flux", "FluxPipeline"): ((2, 16, 64), (2, 16, 16, 3)),  # packed: 4 x 4 tokens of 2 x 2 x 16
    ("flux2", "Flux2Pipeline"): ((2, 16, 16), (2, 16, 16, 3)),  # packed: 4 x 4 tokens of 2 x 2 x 4
    ("flux2", "Flux2KleinPipeline"): ((2, 4, 8, 8), (2, 16, 16, 3)),  # klein returns the VAE's input, unpacked
    ("cogvideox", "CogVideoXPipeline"): ((2, 3, 4, 8, 8), (2, 9, 32, 32, 3)),  # [B, F, C, H, W]; 9 frames
    ("wan", "WanPipeline"): ((2, 4, 2, 8, 8), (2, 5, 64, 64, 3)),  # [B, C, F, H, W]; 5 frames
    ("qwenimage", "QwenImagePipeline"): ((2, 16, 16), (2, 32, 32, 3)),  # packed: 4 x 4 tokens of 2 x 2 x 4
    ("hunyuanvideo", "HunyuanVideoPipeline"): ((2, 4, 2, 8, 8), (2, 5, 64, 64, 3)),  # [B, C, F, H, W]; 5 frames
    ("zimage", "ZImagePipeline"): ((2, 4, 8, 8), (2, 16, 16, 3)),  # 4 x 4 tokens of 2 x 2 latent pixels
    ("sana", "SanaPipeline"): ((2, 4, 8, 8), (2, 32, 32, 3)),  # DC-AE 4x: 32 px, the pipeline's smallest multiple
    # [B, C, F, H, W]; 16x spatial: 4 x 4 latent pixels of 64 px, 5 frames
    # one prompt: diffusers 0.42.1's AutoencoderKLHunyuanVideo15 decodes one video a call (its mid-block attention mask)
    ("hunyuanvideo15", "HunyuanVideo15Pipeline"): ((1, 4, 2, 4, 4), (1, 5, 64, 64, 3)),
    # [B, C, F, H, W]; 4x spatial and temporal: 2 latent frames of 8 x 8, 5 frames of 32 px (its audio beside them)
    ("ltx2", "LTX2Pipeline"): ((2, 4, 2, 8, 8), (2, 5, 32, 32, 3)),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _call(pipe, family, output_type):
    # Flux's, Qwen-Image's and HunyuanVideo's CFG is true_cfg_scale; their guidance_scale is a distilled model's input
    extra = {"true_cfg_scale": 3.0} if family in ("flux", "qwenimage", "hunyuanvideo") else {"guidance_scale": 3.0}
    prompts = ["a red cat", "a blue dog"]
    if family != "flux2":  # guidance-distilled, without a negative prompt (klein's base: CFG on the empty one)
        extra["negative_prompt"] = ["", "photo"]
    if family == "hunyuanvideo15":  # its guider holds the guidance (6 in the tiny folder); one video a decode
        extra, prompts = {"negative_prompt": [""]}, prompts[:1]
    out = pipe(
        prompt=prompts,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type=output_type,
        **extra,
        **tiny_pipeline_kwargs(family),
    )
    return out.frames if family in ("cogvideox", "wan", "hunyuanvideo", "hunyuanvideo15", "ltx2") else out.images


@pytest.mark.parametrize("family, cls", list(EXPECTED))
def test_tiny_pipeline_saves_reloads_and_runs(family, cls, tmp_path):
    from diffusers import DiffusionPipeline

    latent_shape, image_shape = EXPECTED[family, cls]
    default = cls == PIPELINES[family]  # the family's first pipeline is what a plain call builds
    chosen = {} if default else {"pipeline_class": cls}
    assert save_tiny_pipeline(family, tmp_path / "pipe", **chosen) == tmp_path / "pipe"
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["_class_name"] == cls
    assert list((tmp_path / "pipe").rglob("*.safetensors")) and not list((tmp_path / "pipe").rglob("*.bin"))

    pipe = DiffusionPipeline.from_pretrained(tmp_path / "pipe")
    assert type(pipe).__name__ == cls
    pipe.set_progress_bar_config(disable=True)

    latents = _call(pipe, family, "latent")
    assert tuple(latents.shape) == latent_shape and torch.isfinite(latents).all()
    assert torch.equal(latents, _call(pipe, family, "latent"))  # same generator seed, same latents
    images = _call(pipe, family, "np")
    assert images.shape == image_shape and np.isfinite(images).all()


@pytest.mark.parametrize(
    "family",
    ["pixart", "sd3", "flux", "flux2", "cogvideox", "qwenimage", "hunyuanvideo", "zimage", "sana", "hunyuanvideo15"],
)
def test_same_seed_same_weights(family, tmp_path):
    a, b = (save_tiny_pipeline(family, tmp_path / name, seed=seed) for name, seed in [("a", 0), ("b", 0)])
    c = save_tiny_pipeline(family, tmp_path / "c", seed=1)
    weights = lambda root: sorted(p.relative_to(root) for p in root.rglob("*.safetensors"))  # noqa: E731
    assert weights(a) == weights(b) == weights(c)
    for rel in weights(a):
        assert (a / rel).read_bytes() == (b / rel).read_bytes()
    assert any((a / rel).read_bytes() != (c / rel).read_bytes() for rel in weights(a))


def test_tokenizers_reload_with_whole_word_tokens(tmp_path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(save_tiny_pipeline("sd3", tmp_path))
    clip, t5 = pipe.tokenizer, pipe.tokenizer_3
    assert type(clip).__name__ == "CLIPTokenizer" and type(t5).__name__ == "T5Tokenizer"
    assert clip.model_max_length == MAX_TOKENS
    assert clip.convert_ids_to_tokens(clip("A red cat").input_ids) == [
        "<|startoftext|>",
        "a</w>",
        "red</w>",
        "cat</w>",
        "<|endoftext|>",
    ]
    assert t5.convert_ids_to_tokens(t5("a blue dog").input_ids) == ["▁a", "▁blue", "▁dog", "</s>"]
    assert t5("").input_ids == [t5.eos_token_id]
    # Unknown words fall back to characters (bytes for CLIP), never to CLIP's <unk> = end-of-text.
    assert clip("zebra, 7!").input_ids.count(clip.eos_token_id) == 1


def test_flux2_chat_reloads_with_whole_word_tokens(tmp_path):
    """Flux2Pipeline's tokenizer renders its system message and the prompt in Mistral's chat format,
    the message a few dozen tokens (one per word), padded to max_sequence_length as the pipeline asks."""
    from diffusers import DiffusionPipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    tokenizer = DiffusionPipeline.from_pretrained(save_tiny_pipeline("flux2", tmp_path)).tokenizer
    inputs = tokenizer.apply_chat_template(
        format_input(["a red cat"]), tokenize=True, return_dict=True, padding="max_length", max_length=64
    )
    tokens, mask = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0]), inputs["attention_mask"][0]
    text = tokens[64 - sum(mask) :]  # padded on the left, as Mistral's tokenizer pads
    assert set(tokens[: 64 - sum(mask)]) == {"<unk>"} and mask[-sum(mask) :] == [1] * sum(mask)
    assert text[:2] == ["<s>", "[SYSTEM_PROMPT]"] and text[-5:] == ["[INST]", "a", "▁red", "▁cat", "[/INST]"]
    assert 30 < len(text) < 64 and "▁descriptions" in text


def test_flux2_klein_chat_reloads_with_whole_word_tokens(tmp_path):
    """Flux2KleinPipeline's tokenizer renders the prompt in Qwen3's chat as the pipeline asks (the assistant's
    header and, with enable_thinking=False, an empty thinking block after the user's turn), each word one token."""
    from diffusers import DiffusionPipeline

    folder = save_tiny_pipeline("flux2", tmp_path, pipeline_class="Flux2KleinPipeline")
    tokenizer = DiffusionPipeline.from_pretrained(folder).tokenizer
    chat = [{"role": "user", "content": "a red cat"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\na red cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids)
    assert tokens[:7] == ["<|im_start|>", "user", "Ċ", "a", "Ġred", "Ġcat", "<|im_end|>"]
    assert {"<think>", "</think>"} <= set(tokens) and len(tokens) < 32


def test_gemma_tokenizer_reloads_with_whole_word_tokens(tmp_path):
    """SanaPipeline's Gemma tokenizer: <bos> first, one token per known word, characters for the rest, padded on
    the right with <pad> to max_sequence_length as the pipeline asks."""
    from diffusers import DiffusionPipeline

    tokenizer = DiffusionPipeline.from_pretrained(save_tiny_pipeline("sana", tmp_path)).tokenizer
    assert type(tokenizer).__name__ == "GemmaTokenizer"
    tokenizer.padding_side = "right"  # as SanaPipeline sets it
    ids = tokenizer("a red cat", padding="max_length", max_length=MAX_TOKENS).input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["<bos>", "a", "▁red", "▁cat"] + ["<pad>"] * (MAX_TOKENS - 4)
    assert tokenizer.convert_ids_to_tokens(tokenizer("a zebra").input_ids)[-3:] == ["b", "r", "a"]


def test_unknown_family():
    """A family without a pipeline (DiT) and one that does not exist are each named, with the choices."""
    with pytest.raises(ValueError, match="dit has no tiny pipeline; families with one: .*pixart"):
        save_tiny_pipeline("dit", "/nonexistent")
    with pytest.raises(ValueError, match="dit has no tiny pipeline"):
        tiny_pipeline_kwargs("dit")
    with pytest.raises(ValueError, match="unknown tiny family 'pixart-sigma'; choose one of .*pixart"):
        tiny_pipeline_kwargs("pixart-sigma")
