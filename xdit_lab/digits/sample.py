"""Drawing digits with stock diffusers, and scoring them: the calls the model card's figures come from."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .classifier import classify
from .components import DIGITS_DIR, MAX_TOKENS, PIXELS, prompt_for

# The call the model card measured; the trainer writes it into the folder as call_defaults.json,
# which load_pipeline("digits") reads. The sampler itself is whatever scheduler the folder holds.
CALL_DEFAULTS = dict(
    height=PIXELS,
    width=PIXELS,
    num_inference_steps=20,
    guidance_scale=2.0,
    negative_prompt="",
    use_resolution_binning=False,
    clean_caption=False,
    max_sequence_length=MAX_TOKENS,
)


def load_digits_pipeline(folder=None):
    """`PixArtAlphaPipeline.from_pretrained` on the committed model (or `folder`), float32 on CPU."""
    from diffusers import PixArtAlphaPipeline

    from ..pipeline import loading_bars_hidden

    with loading_bars_hidden():  # a 5 MB model: the bars would only clutter a notebook
        pipe = PixArtAlphaPipeline.from_pretrained(str(folder or DIGITS_DIR))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(folder=None, **overrides) -> dict:
    """Keyword arguments for a stock diffusers `pipe(...)` on the digits model: the folder's own
    call_defaults.json (16 pixels, no 256-px binning, no caption cleaning, a short token budget,
    the measured steps and guidance); `overrides` win. `load_pipeline("digits")` applies the same
    file by itself, so a parallel pipeline needs none of these."""
    kwargs = json.loads((Path(folder or DIGITS_DIR) / "call_defaults.json").read_text())
    kwargs.update(overrides)
    return kwargs


def draw_digits(pipe, digits, seeds, output_type="np", **overrides):
    """One image per (digit, seed) pair, each from its own `torch.Generator().manual_seed(seed)`.

    The generators make an image independent of what else is in the batch, so a sample can be
    redrawn alone (or by a parallel run) and compared.
    """
    import torch

    digits, seeds = list(digits), list(seeds)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    return pipe(
        prompt=[prompt_for(d) for d in digits],
        generator=generators,
        output_type=output_type,
        **call_kwargs(**overrides),
    ).images


def measure_accuracy(pipe, per_digit: int = 10, **overrides) -> dict:
    """Draw `per_digit` images of each digit (seeds 0..per_digit-1) and let the classifier read them."""
    digits = [d for d in range(10) for _ in range(per_digit)]
    seeds = [s for _ in range(10) for s in range(per_digit)]
    t0 = time.perf_counter()
    images = draw_digits(pipe, digits, seeds, **overrides)
    seconds = time.perf_counter() - t0
    predicted = classify(images)
    correct = predicted == np.asarray(digits)
    return {
        "accuracy": float(correct.mean()),
        "images": len(digits),
        "seconds": round(seconds, 2),
        "per_digit": [float(correct[d * per_digit : (d + 1) * per_digit].mean()) for d in range(10)],
        "predicted": predicted.tolist(),
    }


def generate_parallel(config, per_digit: int = 10, cache=None, quantization=None, controls=None) -> dict:
    """On a rank of `config`: per_digit images of each digit (seeds 0..per_digit-1, one generator
    each) through load_pipeline (with a StepCache, a quantization, deliberately wrong Controls when
    given); the final latents, what
    the classifier reads, the seconds the denoising steps took, the steps the cache skipped and the
    bytes the transformer's weights hold on this rank."""
    import torch

    from ..models.sharded_weights import local_parameter_bytes
    from ..pipeline import load_pipeline

    digits = [d for d in range(10) for _ in range(per_digit)]
    generators = [torch.Generator().manual_seed(s) for _ in range(10) for s in range(per_digit)]

    pipe = load_pipeline("digits", config, progress=False, cache=cache, quantization=quantization, controls=controls)
    weights = local_parameter_bytes(pipe.diffusers_pipeline.transformer)
    t0 = time.perf_counter()
    session = pipe.session([prompt_for(d) for d in digits], generator=generators)  # the folder's defaults
    session.run()
    latents = session.latents.to("cpu", copy=True)  # a CUDA tensor would not travel back to the parent
    images = session.result(output_type="np").images
    return {
        "latents": latents,
        "read": classify(images).tolist(),
        "digits": digits,
        "seconds": time.perf_counter() - t0,
        "denoise_seconds": sum(session.timings.steps),
        "skips": list(session.cache_skips),
        "transformer_bytes": weights,
    }
