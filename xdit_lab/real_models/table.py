"""The real models as published (/work/shared/REAL-MODELS.md): per component its class, the
library it lives in, its constructor (or configuration) arguments and the dtype its weights are
stored in; per model its pipeline class, the pipeline's own settings model_index.json keeps beside the
components (FLUX.2 klein's is_distilled), and the components model_index.json lists but that hold no
weights here (tokenizers).

The configurations are data, not code: they live in published.json beside this module (shipped as
package data), where the configurations several models share (T5-XXL, CLIP-L, the 16-channel image
VAE, ...) are written once under "configs" and named by a component's `"$extends"`. This module reads
that file into `REAL_MODELS`, with the arguments' types as the constructors take them: arrays among a
component's arguments become tuples (`block_out_channels`, `axes_dims_rope`), arrays nested inside an
argument's dict stay lists (Qwen2.5-VL's `mrope_section`), and dtypes are torch's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

PUBLISHED = Path(__file__).with_name("published.json")


@dataclass(frozen=True)
class Component:
    """One component of a pipeline folder: its class, where the class lives, how it is built and the
    dtype its weights are stored in. For transformers classes, `kwargs` build `config_class`."""

    library: str  # "diffusers" or "transformers"
    class_name: str
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype | None = None  # stored dtype of floating tensors; None: no weights (a scheduler)
    config_class: str | None = None  # transformers: the configuration class the kwargs build


@dataclass(frozen=True)
class RealModel:
    name: str
    pipeline_class: str
    components: dict[str, Component]  # written: configs (and weights, for models)
    listed_only: dict[str, tuple[str, str]] = field(default_factory=dict)  # in model_index.json, not written
    settings: dict = field(default_factory=dict)  # the pipeline's own, in model_index.json (is_distilled)
    # what its model card says to call it with, written as the folder's call_defaults.json (Z-Image-Turbo: 9 steps
    # at guidance 0), which the planner and load_pipeline read as any folder's
    call_defaults: dict = field(default_factory=dict)


def _arguments(written: dict, configs: dict) -> dict:
    """A component's arguments as published.json writes them: the shared configuration its "$extends"
    names (itself maybe extending another), overridden by its own keys; top-level arrays as tuples."""
    written = dict(written)
    base = _arguments(configs[written.pop("$extends")], configs) if "$extends" in written else {}
    return base | {key: tuple(value) if isinstance(value, list) else value for key, value in written.items()}


def _component(written: dict, configs: dict) -> Component:
    dtype = written.get("dtype")
    return Component(
        written["library"],
        written["class_name"],
        _arguments(written.get("kwargs", {}), configs),
        None if dtype is None else getattr(torch, dtype),
        written.get("config_class"),
    )


def load_real_models(path: Path = PUBLISHED) -> dict[str, RealModel]:
    """{name: RealModel} of the models a published.json file lists, in its order."""
    published = json.loads(Path(path).read_text(encoding="utf-8"))
    configs = published["configs"]
    return {
        name: RealModel(
            name,
            model["pipeline_class"],
            {part: _component(written, configs) for part, written in model["components"].items()},
            {part: tuple(where) for part, where in model.get("listed_only", {}).items()},
            model.get("settings", {}),
            model.get("call_defaults", {}),
        )
        for name, model in published["models"].items()
    }


REAL_MODELS = load_real_models()
