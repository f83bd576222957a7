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

The folder read once per load (read_model_folder: a ModelFolder): the index, each component's config, its
safetensors headers (each file's parsed once, ModelFolder.header) and its role (component_role: the
transformer, the expert, a text encoder, an image encoder, a ControlNet, the VAE, or other), which the loaders,
the quantization, the memory plan and the planner ask instead of matching names. What a component holds, cut
where FSDP2 cuts it: per component, the blocks (each an FSDP unit) and the root around them.

    Tensor   one stored tensor as loaded: shape, bytes per element, parameter or buffer
    Weights  a component: root + blocks; whole, held per rank (sharded over N), gathered in a forward
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .families import FAMILIES, FamilyAdapter, Recipe, recipe_for
from .quantization import TRANSFORMERS, quantized_linears, quantized_weight_bytes
from .safetensors_io import CorruptWeightsError, read_safetensors_header
from .sharding import gather_buffer_bytes

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
    if not isinstance(config, dict):
        return None
    adapter = FAMILIES.get(config.get("_class_name"))  # a family that spells them otherwise (Z-Image: n_heads)
    heads = adapter.attention_shape(config)[0] if adapter else config.get("num_attention_heads")
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
    """The folder's own call defaults: what its components' configs set where the pipeline reads them there
    (recipe.folder_defaults), then `call_defaults.json`, checked against what its pipeline takes; {} when the
    folder says none."""
    own = recipe.folder_defaults(Path(folder))
    path = folder / CALL_DEFAULTS
    if not path.is_file():
        return own
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
    return {**own, **defaults}


# ---- the folder as the planner and the loaders read it ------------------------------------------------------


class ModelFolderError(ValueError):
    """A model folder the planner cannot read; the message says what is wrong and what to do."""


# ---- what the folder holds, from its headers -------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One stored tensor as loaded: its shape, bytes per element, and whether FSDP2 shards it (a
    parameter) or leaves it whole on every rank (a buffer)."""

    shape: tuple[int, ...]
    element: int
    parameter: bool = True
    linear: bool = False  # a weight a quantization scheme replaces (quantization.quantized_linears)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.element

    def held_bytes(self, ranks: int = 1, scheme: str | None = None) -> int:
        """What the busiest of `ranks` holds: quantized (a linear weight under a named scheme, never
        sharded: load_pipeline refuses both at once) or its FSDP2 shard."""
        if scheme is not None and self.linear and len(self.shape) == 2:
            return quantized_weight_bytes(self.shape, scheme)
        return self.shard_bytes(ranks)

    def shard_bytes(self, ranks: int) -> int:
        """What the busiest of `ranks` holds: FSDP2 cuts dim 0 as torch.chunk does, ceil(dim0 / ranks)
        rows on the first ranks (and pads every rank's shard to that size)."""
        if ranks == 1 or not self.parameter or not self.shape:
            return self.nbytes
        return -(-self.shape[0] // ranks) * math.prod(self.shape[1:]) * self.element


@dataclass
class Weights:
    """One component's tensors from its safetensors headers, cut where FSDP2 cuts: the blocks (each
    its own FSDP unit, in the forward's order) and the root (everything outside the blocks)."""

    name: str
    class_name: str
    config: dict
    root: list[Tensor]
    blocks: list[list[Tensor]]
    stored_bytes: int  # as stored on disk (the published totals)
    names: list[str] = field(default_factory=list)  # every tensor's name, as the headers give them

    @functools.cached_property
    def whole(self) -> int:
        return sum(t.nbytes for t in self.root) + sum(t.nbytes for block in self.blocks for t in block)

    def held(self, ranks: int = 1, blocks: tuple[int, int] | None = None, scheme: str | None = None) -> int:
        """Bytes one rank holds of the root and blocks [start, stop) (all by default), sharded over `ranks`
        or with its linear weights quantized under `scheme` (quantization.SCHEMES)."""
        start, stop = blocks if blocks is not None else (0, len(self.blocks))
        kept = [t for block in self.blocks[start:stop] for t in block]
        return sum(t.held_bytes(ranks, scheme) for t in (*self.root, *kept))

    def gather(self, ranks: int, blocks: tuple[int, int] | None = None) -> int:
        """The unsharded copies a forward holds at once when sharded over `ranks`, on top of the shards
        (which FSDP2 keeps): three of the largest block of [start, stop) and the root's parameters.

        FSDP2 (torch 2.13, _fsdp_param_group.wait_for_unshard) all-gathers a block into one output
        buffer, copies it out into the block's unsharded parameters, and in the forward frees that
        buffer only at the next block's copy-out, so that the copy-out overlaps the next all-gather:

            block i running      block i unsharded  +  block i's all-gather output (held)
            next one prefetched  +  block i+1's all-gather output
            the root             unsharded from the forward's start to its end (+ its own output
                                 until block 0's copy-out: 2 roots + 2 blocks, if that is more)

        Measured on 3 gloo ranks (tests/test_fit.py, blocks of 38 MB): 118.45 MB of the 118.50 planned.
        There gloo's all-gather adds a temporary of the output's size, which takes the place of the
        next block's output that a GPU's all-gather stream allocates while block i still runs."""
        if ranks == 1:
            return 0
        start, stop = blocks if blocks is not None else (0, len(self.blocks))
        largest = max((sum(t.nbytes for t in b if t.parameter) for b in self.blocks[start:stop]), default=0)
        root = sum(t.nbytes for t in self.root if t.parameter)
        return gather_buffer_bytes(largest, root)


# what xdit_lab does with each component, by its role (component_role)
TRANSFORMER, EXPERT, TEXT_ENCODER, IMAGE_ENCODER, CONTROLNET, VAE, OTHER = (
    "transformer", "expert", "text encoder", "image encoder", "ControlNet", "VAE", "other",
)  # fmt: skip


def component_role(name: str, library: str | None) -> str:
    """What xdit_lab does with a component of a pipeline's index, the one answer every part asks:
    - the transformer, and Wan 2.2 A14B's second expert (transformer_2): parallelized, sharded, quantized;
    - a text encoder (text_encoder, text_encoder_2, ...: a transformers model): sharded over the world with
      shard_weights, kept on the host with on_host, quantized with a named scheme;
    - an image encoder (Wan 2.1 I2V's CLIP vision tower), a ControlNet, the VAE and anything else: loaded whole
      by diffusers, on every rank, at the load dtype."""
    if name == "transformer":
        return TRANSFORMER
    if name in TRANSFORMERS:
        return EXPERT
    if name.startswith("text_encoder") and library == "transformers":
        return TEXT_ENCODER
    if name.startswith("image_encoder"):
        return IMAGE_ENCODER
    if name.startswith("controlnet"):
        return CONTROLNET
    return VAE if name == "vae" else OTHER


@dataclass
class ModelFolder:
    """A pipeline folder read once: the pipeline class, its index, each component's configuration, role and
    tensors, and every safetensors header it parsed (header: each file's parsed once, for the plan, the checks
    and the loaders alike)."""

    path: Path
    pipeline_class: str
    configs: dict[str, dict]  # every component's config.json (and tokenizer configs, where present)
    weights: dict[str, Weights]  # components with weights, as loaded in the plan's dtype
    element: int  # bytes per element of the plan's dtype
    notes: list[str] = field(default_factory=list)
    stale_layers: list[int] | None = None  # per block, filled by stale_layers()
    index: dict = field(default_factory=dict)  # model_index.json, as read (or as load_pipeline was told)
    headers: dict = field(default_factory=dict, repr=False)  # file -> its checked tensor table (header)

    @property
    def transformer(self) -> Weights:
        return self.weights["transformer"]

    @property
    def adapter(self) -> FamilyAdapter:
        return FAMILIES[self.transformer.class_name]

    @property
    def recipe(self) -> Recipe:
        """The recipe of its pipeline class, as its model_index.json's settings make it (families.recipe_for)."""
        return recipe_for(self.pipeline_class, self.index)

    @property
    def components(self) -> list[str]:
        """The components the index lists (not left out as [null, null]), in its order."""
        return [name for name, entry in self.index.items() if _listed(name, entry)]

    @property
    def roles(self) -> dict[str, str]:
        """{component: its role} (component_role), in the index's order."""
        return {name: component_role(name, self.index[name][0]) for name in self.components}

    def named(self, *roles: str) -> list[str]:
        """The components of these roles, in the index's order."""
        return [name for name, role in self.roles.items() if role in roles]

    @property
    def text_encoders(self) -> list[str]:
        """The text encoders: what shard_weights shards over the world, on_host keeps on the host and a named
        quantization scheme quantizes (an image encoder is none of them: whole, as diffusers loads it)."""
        return self.named(TEXT_ENCODER)

    @property
    def quantizable(self) -> list[str]:
        """What a named quantization scheme quantizes: the transformer, the expert and the text encoders."""
        return self.named(TRANSFORMER, EXPERT, TEXT_ENCODER)

    def header(self, path) -> dict:
        """The checked tensor table of a safetensors file (safetensors_io.read_safetensors_header), parsed on
        the first question and kept: one parse per file per load."""
        path = Path(path)
        if path not in self.headers:
            self.headers[path] = read_safetensors_header(path)
        return self.headers[path]

    def in_dtype(self, dtype: torch.dtype) -> ModelFolder:
        """The same folder planned in `dtype`, from the configs already read and the headers already parsed."""
        if torch.empty((), dtype=dtype).element_size() == self.element:
            return self
        return read_model_folder(self.path, dtype, index=self.index, headers=self.headers, configs=self.configs)


def _listed(name: str, entry) -> bool:
    return not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and None not in entry


def read_model_folder(
    folder, dtype: torch.dtype = torch.bfloat16, *, index=None, headers=None, configs=None
) -> ModelFolder:
    """Read a diffusers folder's index, configs and safetensors headers (no weights), checking each. `index`:
    the folder's model_index.json already read and checked (load_pipeline's); `headers`: a header cache to share
    (ModelFolder.headers); `configs`: the configs already read (ModelFolder.configs), each read at most once."""
    path = Path(folder).expanduser()
    if not path.exists():
        raise ModelFolderError(f"no model folder at {path}: pass a diffusers pipeline folder (with model_index.json)")
    if not path.is_dir():
        raise ModelFolderError(
            f"{path} is a file, not a folder: pass the diffusers pipeline folder that holds model_index.json"
        )
    index = read_json(path / "model_index.json", "the pipeline's index") if index is None else index
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise ModelFolderError(
            f"{path / 'model_index.json'} is not a diffusers pipeline index: it needs a JSON object with "
            f'"_class_name" (the pipeline class) and one [library, class] entry per component'
        )
    pipeline_class = index["_class_name"]
    element = torch.empty((), dtype=dtype).element_size()
    model = ModelFolder(path, pipeline_class, {}, {}, element, index=index, headers={} if headers is None else headers)
    for name, entry in index.items():
        if not _listed(name, entry):
            continue
        library, class_name = entry
        sub = path / name
        known = (configs or {}).get(name)  # as a first read left it: config.json where there are weights
        if known is not None:
            model.configs[name] = known
        elif (sub / "tokenizer_config.json").is_file():
            model.configs[name] = read_json(sub / "tokenizer_config.json", f"{name}'s tokenizer configuration")
        if not _has_weights(library, class_name, sub):
            continue
        if not sub.is_dir():
            raise ModelFolderError(
                f"model_index.json lists the component {name!r} ({library} {class_name}), but {sub} is missing: "
                f"copy the whole pipeline folder, or remove {name!r} from model_index.json if it is not used"
            )
        config = known if known is not None else read_json(sub / "config.json", f"{name}'s configuration")
        model.configs[name] = config
        model.weights[name] = _read_weights(name, library, class_name, config, sub, element, model.notes, model.header)
    if "transformer" not in model.weights:
        raise ModelFolderError(f"{path} has no transformer component with weights: the planner plans a DiT pipeline")
    if model.transformer.class_name not in FAMILIES:
        raise ModelFolderError(
            f"xdit_lab does not parallelize {model.transformer.class_name}; supported transformers: {', '.join(FAMILIES)}"
        )
    return model


def read_component(folder, dtype: torch.dtype = torch.bfloat16, *, library: str = "diffusers") -> Weights:
    """One component folder's Weights (config.json's class, its safetensors headers), as loaded in `dtype`."""
    path = Path(folder)
    config = read_json(path / "config.json", f"{path.name}'s configuration")
    class_name = config.get("_class_name") or (config.get("architectures") or ["?"])[0]
    element = torch.empty((), dtype=dtype).element_size()
    return _read_weights(path.name, library, class_name, config, path, element, [])


def read_json(path: Path, what: str):
    if not path.is_file():
        raise ModelFolderError(
            f"{path} is missing ({what}): pass a complete diffusers pipeline folder"
            + (" (model_index.json is at its top)" if path.name == "model_index.json" else "")
        )
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFolderError(f"{path} is not valid JSON ({error}): save or copy it again") from None


def component_class(library: str, class_name: str):
    """The class model_index.json names for a component: in a library ("diffusers", "transformers"), or in a
    diffusers pipeline's own module (LTX-2's connectors and vocoder: "ltx2", diffusers.pipelines.ltx2), as
    diffusers' loader finds it."""
    try:
        module = importlib.import_module(library)
    except ModuleNotFoundError:
        module = importlib.import_module(f"diffusers.pipelines.{library}")
    return getattr(module, class_name)


def _has_weights(library: str, class_name: str, sub: Path) -> bool:
    """Whether a component holds weights: its class is a torch module (a model, not a tokenizer or a
    scheduler); for a class that cannot be imported here, whether its folder has safetensors."""
    try:
        cls = component_class(library, class_name)
    except (ImportError, AttributeError):
        return any(sub.glob("*.safetensors"))
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def _read_weights(
    name, library, class_name, config, sub: Path, element: int, notes: list, header=read_safetensors_header
) -> Weights:
    files = sorted(sub.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(
            f"{sub} has no .safetensors files: the planner reads safetensors headers only "
            f"(re-save the component with safe_serialization=True)"
        )
    for index_file in sub.glob("*.safetensors.index.json"):
        listed = read_json(index_file, f"{name}'s shard index").get("weight_map", {})
        missing = sorted({file for file in listed.values() if not (sub / file).is_file()})
        if missing:
            raise ModelFolderError(
                f"{index_file} names weight files that are missing: {', '.join(missing)}; copy them too"
            )
    headers = {}
    for file in files:
        try:
            table = header(file)
            headers.update({key: (info["dtype"], tuple(info["shape"])) for key, info in table.items()})
        except (KeyError, TypeError, AttributeError) as error:
            raise CorruptWeightsError(
                f"{file} has a malformed safetensors header ({type(error).__name__}: {error}); save or copy it again"
            ) from None
    buffers, linears, rename = _module_facts(library, class_name, config, notes, name)
    adapter = FAMILIES.get(class_name) if name in TRANSFORMERS else None  # an expert too
    root: list[Tensor] = []
    blocks: dict = {}
    stored = 0
    for key, (dtype, shape) in headers.items():
        stored_element = _SAFETENSORS_BYTES.get(dtype, 4)
        stored += math.prod(shape) * stored_element
        mine = rename(key) or key  # the module's name for it (transformers renames some checkpoints' keys)
        tensor = Tensor(shape, element if dtype in _FLOATS else stored_element, mine not in buffers, mine in linears)
        block = adapter.block_index(key, config) if adapter is not None else _encoder_block(key)
        (root if block is None else blocks.setdefault(block, [])).append(tensor)
    if adapter is not None:  # stacked order, every block the config names (an empty one holds nothing)
        ordered = [blocks.get(i, []) for i in range(adapter.num_blocks(config))]
    else:
        ordered = list(blocks.values())
    return Weights(name, class_name, config, root, ordered, stored, list(headers))


_FLOATS = {"F64", "F32", "F16", "BF16"}  # cast to the plan's dtype on load, as load_pipeline's torch_dtype does
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}
_SAFETENSORS_BYTES.update(BOOL=1, F8_E4M3=1, F8_E5M2=1)
_NUMBERED = re.compile(r"^(.*?\.\d+)\.")


def _encoder_block(key: str) -> str | None:
    """A text encoder's block: the first numbered module in the tensor's name ('encoder.block.3',
    'text_model.encoder.layers.11', 'model.language_model.layers.0'), None outside any list."""
    match = _NUMBERED.match(key)
    return match.group(1) if match else None


def _module_facts(library, class_name, config, notes, name):
    """(persistent buffers, quantized weights, file key -> module key) of the class built from its
    configuration on the meta device: the buffers FSDP2 leaves whole (SD3's pos_embed), the nn.Linear
    weights a quantization scheme replaces (the library's own rules, quantization.quantized_linears), and
    transformers' renaming of a checkpoint's keys."""
    found = _facts_of(library, class_name, json.dumps(config, sort_keys=True))
    if isinstance(found, str):  # an exotic class: plan every tensor as a sharded, unquantized parameter, and say so
        notes.append(f"{name}: {class_name} could not be built from its config ({found}); its buffers count as sharded")
        return frozenset(), frozenset(), lambda key: key
    return found


@functools.lru_cache(maxsize=64)
def _facts_of(library: str, class_name: str, config_json: str):
    """_module_facts, cached (a few tenths of a second for a model of billions of parameters), or why the
    class could not be built."""
    from .shard_loading import transformers_key_renaming

    config = json.loads(config_json)
    try:
        cls = component_class(library, class_name)
        with torch.device("meta"):
            model = cls(cls.config_class.from_dict(config)) if library == "transformers" else cls.from_config(config)
        rename = (transformers_key_renaming(model) if library == "transformers" else None) or (lambda key: key)
    except Exception as error:  # noqa: BLE001 - any failure only means the module's facts stay unknown
        return f"{type(error).__name__}: {error}"
    parameters = {key for key, _ in model.named_parameters()}
    buffers = frozenset(key for key in model.state_dict() if key not in parameters)
    return buffers, quantized_linears(model, library), rename
