"""A diffusers pipeline folder, read and checked before anything is loaded: a bundled name or a path
(resolve_folder), its model_index.json (read_model_index), the component subfolders it lists
(component_folders) and the folder's own call defaults (read_call_defaults: `call_defaults.json` beside
model_index.json). Each problem is raised at once, naming the file and what to do; each model's weights
are checked against its config.json by loading.check_weights_match_configs.

    my-pipeline/
      model_index.json        {"_class_name": "PixArtAlphaPipeline", "transformer": ["diffusers", ...], ...}
      call_defaults.json      optional: {"num_inference_steps": 20, "height": 256, ...}
      transformer/            config.json + *.safetensors (loading.py checks one against the other)
      text_encoder/ ...
"""

from __future__ import annotations

import json
from pathlib import Path

BUNDLED = {"digits": Path(__file__).parent / "assets" / "digits"}
CALL_DEFAULTS = "call_defaults.json"  # a folder's own defaults for pipe(...), beside model_index.json
CALL_ARGUMENTS = ("negative_prompt", "num_inference_steps", "guidance_scale", "height", "width")


def resolve_folder(name_or_path) -> Path:
    folder = BUNDLED.get(str(name_or_path), Path(name_or_path)).expanduser()
    if folder.is_file():
        above = folder.parent / "model_index.json"
        raise NotADirectoryError(
            f"{folder} is a file, not a pipeline folder: pass the folder that holds model_index.json"
            + (f" ({folder.parent})" if above.is_file() else "")
        )
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no pipeline folder at {folder}: pass a local diffusers pipeline folder "
            f"(with model_index.json) or a bundled name ({', '.join(BUNDLED)})"
        )
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"{folder} has no model_index.json: it is not a diffusers pipeline folder")
    return folder


def transformer_heads(name_or_path) -> int | None:
    """The attention heads in the folder's transformer/config.json, read as plain JSON (no library imported), so
    that a degree's advice can fit them before anything loads; None where the folder does not say (the load itself
    then names what is wrong)."""
    try:
        config = json.loads((resolve_folder(name_or_path) / "transformer" / "config.json").read_text())
    except (OSError, ValueError):  # no folder, no config, not JSON: the load says it
        return None
    heads = config.get("num_attention_heads") if isinstance(config, dict) else None
    return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else None


def read_model_index(folder: Path) -> dict:
    """The folder's model_index.json, checked: a JSON object naming its pipeline class (`_class_name`), each
    component a [library, class] pair ([null, null]: left out)."""
    path = folder / "model_index.json"
    try:
        index = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}): save or copy the pipeline folder again") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise ValueError(
            f'{path} is not a diffusers pipeline index: it must be a JSON object with "_class_name" (the '
            f'pipeline class, e.g. "PixArtAlphaPipeline") and one [library, class] entry per component; '
            + ('it has no "_class_name"' if isinstance(index, dict) else f"it holds {str(index)[:100]}")
        )
    wrong = [
        f"{name}: {entry!r}"
        for name, entry in index.items()
        if not name.startswith("_")
        and isinstance(entry, list)
        and not (len(entry) == 2 and all(part is None or isinstance(part, str) for part in entry))
    ]
    if wrong:
        raise ValueError(
            f"{path} has component entries that are not [library, class] pairs: {'; '.join(wrong)}; each "
            f'component is ["diffusers", "AutoencoderKL"] or the like, [null, null] where left out'
        )
    return index


def component_folders(folder: Path, index: dict) -> list[str]:
    """The components model_index.json lists (not left out as [null, null]), each a subfolder: a missing one is
    named (diffusers would stop with "no file named model.safetensors ... found in directory" of the pipeline)."""
    listed = {
        name: entry
        for name, entry in index.items()
        if not name.startswith("_") and isinstance(entry, list) and None not in entry
    }
    missing = [f"{name}/ ({'.'.join(entry)})" for name, entry in listed.items() if not (folder / name).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks component folder(s) its model_index.json lists: {', '.join(missing)}. Copy the whole "
            f"pipeline folder, or mark a component the pipeline can run without as [null, null] in model_index.json"
        )
    return list(listed)


def read_call_defaults(folder: Path, recipe) -> dict:
    """The folder's own call defaults (`call_defaults.json`), checked against what its pipeline takes;
    {} when the folder has none."""
    path = folder / CALL_DEFAULTS
    if not path.is_file():
        return {}
    try:
        defaults = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    allowed = (*CALL_ARGUMENTS, *recipe.options)
    unknown = sorted(set(defaults) - set(allowed)) if isinstance(defaults, dict) else None
    if unknown is None or unknown:
        raise ValueError(
            f"{path} must be a JSON object of {recipe.family} call arguments ({', '.join(allowed)}); "
            f"it has {unknown if unknown is not None else type(defaults).__name__}"
        )
    return defaults
