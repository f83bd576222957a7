"""What a family's tiny specimen is made of, as data: every family file holds one `TINY` (xdit_lab.tiny
builds from it the random transformer, its forward's inputs and a whole stock diffusers pipeline).

    TINY = TinySpec(
        transformer=dict(patch_size=1, in_channels=16, ...),   # beside the sizes every family shares
        inputs=tiny_inputs,                                     # the forward's keyword arguments
        parts=dict(text_encoder=Part("t5_encoder", seed=1, vocab_of="tokenizer"), ...),
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
    """One component of a tiny pipeline: `builder` names a function of xdit_lab.tiny.parts (or a diffusers
    scheduler class), called with the pipeline's seed + `seed` where the part has weights (None: a
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
    parts: dict = field(default_factory=dict)  # component -> Part
    call: dict = field(default_factory=dict)  # arguments that run the pipeline at a tiny size (a Part: built)
