"""What a family's tiny specimen is made of, as data: every family file holds one `TINY` (xdit_lab.tiny
builds from it the random transformer, its forward's inputs and a whole stock diffusers pipeline).

    TINY = TinySpec(
        transformer=dict(patch_size=1, in_channels=16, ...),   # beside the sizes every family shares
        inputs=tiny_inputs,                                     # the forward's keyword arguments
        parts=dict(**text_parts("t5", seed=1), vae=Part("image_vae", seed=2, ...), ...),
        call=dict(height=16, width=16, max_sequence_length=MAX_TOKENS),
    )

Sizes: every tiny transformer has HEADS × HEAD_DIM attention and two layers; text is TEXT_DIM wide and
MAX_TOKENS long (CLIP's model_max_length, and `max_sequence_length` for T5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

HEADS, HEAD_DIM, TEXT_DIM = 4, 16, 32
MAX_TOKENS = 8
INNER = "heads × head_dim"  # a transformer setting that takes the model's attention width


@dataclass(frozen=True)
class Part:
    """One component of a tiny pipeline: `builder` names a function of xdit_lab.tiny's tokenizers.py, encoders.py
    or vaes.py (or a diffusers scheduler class), called with the pipeline's seed + `seed` where the part has weights (None: a
    tokenizer, a scheduler) and, for a text encoder, the vocabulary size of the tokenizer component
    `vocab_of`; `kwargs` as given. "transformer": the family's tiny transformer, `kwargs` overriding its
    settings."""

    builder: str
    seed: int | None = None
    vocab_of: str | None = None
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TinySpec:
    transformer: dict  # constructor settings beside heads, head_dim and layers (INNER: the attention width)
    inputs: Callable  # (batch, height, width, text, timestep, randn) -> the forward's keyword arguments
    pipeline_classes: tuple = ()  # diffusers pipelines the parts make (the first by default); () for none
    # component -> Part; a pipeline's "transformer" is the family's tiny transformer unless a Part says otherwise
    parts: dict = field(default_factory=dict)
    call: dict = field(default_factory=dict)  # arguments that run the pipeline at a tiny size (a Part: built)
    # another of `pipeline_classes` -> the parts where its pipeline differs from the first's (Flux.2 klein's text)
    class_parts: dict = field(default_factory=dict)
    heads: int = HEADS  # the attention heads of the tiny transformer, unless a caller asks for others
    # the constructor's names of the shared sizes, where the transformer spells them otherwise: each of
    # num_attention_heads, attention_head_dim and num_layers -> the settings that take it (() for none)
    size_names: dict = field(default_factory=dict)

    def parts_of(self, pipeline_class: str) -> dict:
        """The parts of `pipeline_class`'s tiny pipeline: the family's, with the class's own in place."""
        return {**self.parts, **self.class_parts.get(pipeline_class, {})}

    def __post_init__(self):
        if self.pipeline_classes and "transformer" not in self.parts:
            object.__setattr__(self, "parts", {"transformer": Part("transformer"), **self.parts})


def text_parts(kind: str, seed: int, component: str = "", **kwargs) -> dict[str, Part]:
    """A text encoder and its tokenizer, the encoder sized by its tokenizer's vocabulary: `kind` names
    both builders of xdit_lab.tiny (`t5`: encoders.t5_encoder and tokenizers.t5_tokenizer), `component` the suffix of
    both components ("_2": text_encoder_2 and tokenizer_2), `kwargs` the encoder's."""
    tokenizer = f"tokenizer{component}"
    encoder = Part(f"{kind}_encoder", seed=seed, vocab_of=tokenizer, kwargs=kwargs)
    return {f"text_encoder{component}": encoder, tokenizer: Part(f"{kind}_tokenizer")}


def flow_scheduler(shift: float, **dynamic) -> Part:
    """diffusers' FlowMatchEulerDiscreteScheduler with `shift` (SD3, Wan, HunyuanVideo); given `dynamic`
    (its max_shift and max_image_seq_len, ...), a shift that grows with the image's tokens from
    base_shift 0.5 at 256 tokens (Flux, Flux.2, Qwen-Image)."""
    if dynamic:
        dynamic = dict(use_dynamic_shifting=True, base_shift=0.5, base_image_seq_len=256, **dynamic)
    return Part("FlowMatchEulerDiscreteScheduler", kwargs=dict(shift=shift, **dynamic))


def flow_vae(scaling_factor: float, shift_factor: float) -> Part:
    """SD3's and Flux's VAE: an AutoencoderKL of 16 latent channels without quant convs (the real ones'
    layout), its latents scaled and shifted by the family's own factors."""
    kwargs = dict(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
    return Part("image_vae", seed=2, kwargs=dict(kwargs, scaling_factor=scaling_factor, shift_factor=shift_factor))
