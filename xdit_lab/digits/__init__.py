"""The embedded default model: a tiny PixArt-alpha pipeline that draws scikit-learn's digits.

    from xdit_lab.digits import DIGITS_DIR, prompt_for, digit_accuracy
    pipe = PixArtAlphaPipeline.from_pretrained(DIGITS_DIR)      # stock diffusers, a few MB, CPU
    images = pipe(prompt_for(7), height=16, width=16, use_resolution_binning=False,
                  clean_caption=False, max_sequence_length=8, output_type="np").images

`xdit_lab/assets/digits/README.md` is its model card; `train_digits` remakes it.
"""

from .classifier import classify, digit_accuracy
from .components import DIGITS_DIR, prompt_for
from .sample import call_kwargs, draw_digits, load_digits_pipeline, measure_accuracy


def __getattr__(name):
    # Imported on first use, so `python -m xdit_lab.digits.train` does not find its own module
    # already loaded by the package (runpy warns about that).
    if name == "train_digits":
        from .train import train_digits

        return train_digits
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DIGITS_DIR",
    "prompt_for",
    "train_digits",
    "classify",
    "digit_accuracy",
    "call_kwargs",
    "draw_digits",
    "load_digits_pipeline",
    "measure_accuracy",
]
