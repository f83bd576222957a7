"""Per-rank loading: a rank materialises only what it will hold.

`load_own_components` says which components a rank builds itself (load_pipeline hands the rest to diffusers).
Every component loaded here is built with empty (meta) parameters (empty_model), cut to what this rank
keeps, and filled with plain reads at the byte ranges the safetensors headers give
(shard_loading.load_weights: no file is mapped):
  - a PipeFusion stage keeps only its own blocks of the transformer (keep_stage, load_stage_transformer);
  - with sharded weights (load_pipeline(..., shard_weights=True)) the model is sharded with FSDP2 first
    (models.sharded_weights), and each rank reads only its rows of every parameter (load_sharded).
`read_tensors` reads named tensors through mmap, and with plain reads where mmap is refused ("Unable to
mmap N bytes").
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .families import FAMILIES
from .mesh import PIPEFUSION
from .model_folder import EXPERT, TEXT_ENCODER, TRANSFORMER, ModelFolder
from .quantization import QuantizationError
from .safetensors_io import SAFETENSORS_DTYPES, read_safetensors_header, safetensors_files
from .shard_loading import WeightsMismatchError, load_weights, materialize, transformers_key_renaming

SHOWN = 6  # keys named in one line of a mismatch error; the rest are counted


def read_tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of one safetensors file, through mmap, or plain reads if mmap fails."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in keys}
    except (OSError, RuntimeError) as error:
        if "mmap" not in str(error).lower():
            raise
    header = read_safetensors_header(path)
    tensors = {}
    with open(path, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")  # after the length and the JSON header
        for key in keys:
            info = header[key]
            start, stop = info["data_offsets"]
            f.seek(data_start + start)
            raw = bytearray(f.read(stop - start))
            tensors[key] = torch.frombuffer(raw, dtype=SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    return tensors


def empty_model(folder: Path, library: str, class_name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A component's class built from its folder's config with empty (meta) parameters in `dtype` and real
    buffers (accelerate's init_empty_weights keeps them: the rotary and position tables computed at
    construction are in no checkpoint). A transformers model's tied weights are tied here, as its own
    loader ties them, so that the one stored copy fills both names."""
    import importlib

    from accelerate import init_empty_weights

    cls = getattr(importlib.import_module(library), class_name)
    with init_empty_weights():
        if library == "transformers":
            from transformers import AutoConfig

            model = cls._from_config(AutoConfig.from_pretrained(folder))
        else:
            model = cls.from_config(cls.load_config(folder))
    if library == "transformers":
        model.tie_weights()
    cast: dict[int, torch.nn.Parameter] = {}  # one new parameter per old one: tied weights stay tied
    for module in model.modules():  # parameters only: buffers keep the dtype they were built in, as diffusers'
        for name, parameter in list(module._parameters.items()):
            if parameter is not None and parameter.is_floating_point() and parameter.dtype != dtype:
                if id(parameter) not in cast:  # on meta: no memory, no copy
                    cast[id(parameter)] = torch.nn.Parameter(parameter.to(dtype), requires_grad=False)
                module._parameters[name] = cast[id(parameter)]
    return model.eval()


def check_weights_match_config(folder: Path, library: str, class_name: str, header=read_safetensors_header) -> None:
    """Refuse a component whose config.json does not build the module its safetensors hold: the module is
    built from the config on meta (no memory) and its parameters are compared, by name and shape, with the
    files' headers, before a byte of weights is read. Without this, diffusers loads a config with fewer
    layers than its weights without a word (the extra ones dropped), fails on one with more as "Cannot copy
    out of meta tensor", and transformers fills the missing layers of a text encoder with random numbers.

    Names as the libraries' loaders read them: diffusers' renaming of old attention keys, transformers'
    checkpoint renaming, the keys each class declares it ignores; tied weights count once, and a buffer
    missing from the files keeps the value the module was built with (as both loaders keep it). A component
    with no safetensors files (.bin only), or whose checkpoint transformers converts tensor by tensor, is
    left to the library's loader. `header`: a file's tensor table (ModelFolder.header: parsed once per load)."""
    try:
        files = safetensors_files(folder)
    except FileNotFoundError:
        return
    stored = {}
    for file in files:
        stored.update({key: (file, info["shape"]) for key, info in header(file).items()})
    model = empty_model(folder, library, class_name, torch.float32)
    if library == "diffusers" and hasattr(model, "_fix_state_dict_keys_on_load"):
        model._fix_state_dict_keys_on_load(stored)  # old VAE attention names, as diffusers renames them on load
    rename = None
    if library == "transformers":
        try:
            rename = transformers_key_renaming(model)
        except NotImplementedError:
            return
    if rename is not None:
        stored = {rename(key): value for key, value in stored.items()}
    ignored_unexpected = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    ignored_missing = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    module_tensors = model.state_dict(keep_vars=True)
    parameters = {id(p) for p in model.parameters()}
    names_of: dict[int, list[str]] = {}
    for name, tensor in module_tensors.items():
        names_of.setdefault(id(tensor), []).append(name)
    unexpected = [
        key
        for key in stored
        if key not in module_tensors and not any(re.search(pattern, key) for pattern in ignored_unexpected)
    ]
    missing = [
        names[0]
        for key, names in names_of.items()
        if key in parameters
        and not any(name in stored for name in names)
        and not any(re.search(pattern, names[0]) for pattern in ignored_missing)
    ]
    shapes = [
        f"{key!r} is {tuple(shape)} in {file.name} but {tuple(module_tensors[key].shape)} in the module"
        for key, (file, shape) in stored.items()
        if key in module_tensors and tuple(shape) != tuple(module_tensors[key].shape)
    ]
    if not (unexpected or missing or shapes):
        return

    def listed(keys):
        return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")

    lines = []
    if missing:
        lines.append(f"{len(missing)} parameter(s) of the module are in no file: {listed(missing)}")
    if unexpected:
        lines.append(f"{len(unexpected)} tensor(s) in the files have no place in the module: {listed(unexpected)}")
    if shapes:
        lines.append(f"{len(shapes)} tensor(s) differ in shape: {listed(shapes)}")
    raise WeightsMismatchError(
        f"{folder / 'config.json'} does not match the weights beside it ({', '.join(f.name for f in files)}): "
        f"the {class_name} it builds is not the one they were saved from.\n  - "
        + "\n  - ".join(lines)
        + "\nCopy the config.json saved with these weights (or the weights saved with this config)"
    )


def check_weights_match_configs(model: ModelFolder, components: list[str]) -> None:
    """Every component with weights (a diffusers or transformers model) against its config.json
    (loading.check_weights_match_config), before any weight is read, from the headers the folder parsed."""
    import importlib

    for name in components:
        library, class_name = model.index[name]
        if library not in ("diffusers", "transformers"):
            continue
        try:
            cls = getattr(importlib.import_module(library), class_name)
        except (ImportError, AttributeError):
            continue  # diffusers' own loader names a class it cannot find
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            check_weights_match_config(model.path / name, library, class_name, model.header)


def keep_stage(model, class_name: str, stage_blocks: tuple[int, int]):
    """Drop the blocks outside PipeFusion stage [start, stop) from an empty transformer; returns the
    file key -> module key renaming of the stage's tensors (None for another stage's block)."""
    adapter = FAMILIES[class_name]
    total = adapter.num_blocks(model.config)
    start, stop = stage_blocks
    stage_name = stage_key_renaming(model.config, class_name, stage_blocks)
    adapter.keep_blocks(model, start, stop)
    model._xdit_lab_stage_blocks = (start, stop, total)
    return stage_name


def stage_key_renaming(transformer_config, class_name: str, stage_blocks: tuple[int, int]):
    """The whole transformer's key -> its name in PipeFusion stage [start, stop) (None: another stage's block), for
    the checkpoint's tensors (keep_stage) and for a LoRA's (lora.fuse_lora)."""
    adapter = FAMILIES[class_name]
    start, stop = stage_blocks
    # a kept block's name in the model -> its name in this stage
    renamed = {whole: mine for mine, whole in adapter.stage_block_names(transformer_config, start, stop).items()}

    def stage_name(key: str) -> str | None:
        index = adapter.block_index(key, transformer_config)
        if index is None:
            return key
        if not start <= index < stop:
            return None
        block_list, position, rest = key.split(".", 2)
        return f"{renamed[f'{block_list}.{position}']}.{rest}"

    return stage_name


def load_stage_transformer(
    folder: Path, class_name: str, stage_blocks: tuple[int, int], dtype: torch.dtype, device, header=None
):
    """The diffusers transformer in `folder` with only its stacked blocks [start, stop) materialised
    (Flux's stack: its double-stream blocks, then its single-stream ones), on `device`. `header`, here and
    below: a file's tensor table parsed once per load (ModelFolder.header), else read by load_weights."""
    model = empty_model(folder, "diffusers", class_name, dtype)
    stage_name = keep_stage(model, class_name, stage_blocks)
    # plain reads of this stage's tensors only, never a mapping of the whole file (shard_loading.py)
    load_weights(materialize(model, "cpu", dtype=dtype), folder, dtype=dtype, rename=stage_name, header=header)
    # read in host memory, then to the device: load_pipeline's place() leaves what a rank built where it is
    return model.to(device).eval()


def load_sharded_transformer(
    folder: Path, class_name: str, config, mesh, dtype, device, header=None, **parallel
) -> torch.nn.Module:
    """The transformer in `folder` parallelized under `config` with its weights sharded (FSDP2 over the ranks
    of its stage), built empty and filled with this rank's rows only: no rank reads or maps the whole
    checkpoint. `parallel`: parallelize's other options (cache, compile, controls).

    Under tp > 1 a rank's rows are an FSDP2 chunk of its tp slice (a rowwise weight's columns, a packed layer's
    blocks), which is not one byte range of the file: the transformer is read whole into host memory (the loading
    peak of tp without shards), split and sharded, then moved to the device, where it holds its shards only."""
    from .models import parallelize

    model = empty_model(folder, "diffusers", class_name, dtype)
    if config.tp > 1:  # never with PipeFusion: parallelize refuses tp with it
        load_weights(materialize(model, "cpu", dtype=dtype), folder, dtype=dtype, header=header)
        return parallelize(model.to(device).eval(), config, mesh, shard_weights=True, **parallel)
    rename = None
    if config.pipefusion > 1:  # a stage keeps its own blocks, then shards them over the stage's ranks
        blocks = config.stage_ranges(FAMILIES[class_name].num_blocks(model.config))[mesh.coords[PIPEFUSION]]
        rename = keep_stage(model, class_name, blocks)
    parallelize(model, config, mesh, shard_weights=True, **parallel)
    return load_sharded(model, folder, dtype, device, rename, header)


def load_sharded_text_encoder(folder: Path, class_name: str, mesh, dtype, device, header=None) -> torch.nn.Module:
    """A transformers text encoder sharded over the world (FSDP2: models.sharded_weights.shard_text_encoder),
    built empty and filled with this rank's rows only."""
    from .models import shard_text_encoder

    model = empty_model(folder, "transformers", class_name, dtype)
    rename = transformers_key_renaming(model)  # before sharding: transformers finds the mapping by the class
    shard_text_encoder(model, mesh)
    return load_sharded(model, folder, dtype, device, rename, header)


def load_sharded(model, folder: Path, dtype: torch.dtype, device, rename=None, header=None) -> torch.nn.Module:
    """Fill an empty model that is already sharded (FSDP2: models.sharded_weights) from its folder: each
    rank materializes and reads only its own rows of every parameter, and whole buffers
    (shard_loading.materialize, load_weights). A transformers model's file keys are renamed to its
    module's by `rename` (transformers_key_renaming, found before the model was sharded)."""
    load_weights(materialize(model, device, dtype=dtype), folder, dtype=dtype, rename=rename, header=header)
    return model.eval()


def load_quantized(
    model, library: str, folder: Path, dtype, device, quantization, name: str, lists, rename=None, header=None
):
    """Fill an empty model block by block, quantizing each as soon as it is read (quantization.py): the
    model's outside-the-blocks part first (its linear layers quantized too), then each block of `lists`
    ([(attribute, nn.ModuleList)], in the model's order) read, quantized, kept. So a rank holds the
    quantized blocks and one block in full precision, never the whole model at the load dtype. `rename`: a
    file key -> module key mapping of the model's keys (a PipeFusion stage's, transformers' conversion)."""
    from .quantization import quantize_block, quantized_linears

    config = quantization.config_for(name)
    chosen = quantized_linears(model, library, quantization.skipped(name))  # by the library's own rules
    rename = rename or (lambda key: key)
    held = {attribute: layers for attribute, layers in lists}

    def put(attribute, layers):  # `attribute` may be dotted: the list sits on a submodule
        parent, _, leaf = attribute.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layers)

    for attribute in held:  # the blocks apart: the rest of the model is loaded and quantized without them
        put(attribute, torch.nn.ModuleList())

    def outside_blocks(key):
        mine = rename(key)
        return None if mine is None or any(mine.startswith(f"{a}.") for a in held) else mine

    load_weights(materialize(model, device, dtype=dtype), folder, dtype=dtype, rename=outside_blocks, header=header)
    quantize_block(model, config, chosen)
    for attribute, layers in held.items():
        for index, block in enumerate(layers):
            prefix = f"{attribute}.{index}."

            def in_block(key, prefix=prefix):
                mine = rename(key)
                return mine[len(prefix) :] if mine is not None and mine.startswith(prefix) else None

            load_weights(materialize(block, device, dtype=dtype), folder, dtype=dtype, rename=in_block, header=header)
            quantize_block(block, config, chosen, prefix=prefix)
        put(attribute, layers)
    return model.eval()


def load_quantized_transformer(
    folder: Path,
    class_name: str,
    dtype,
    device,
    quantization,
    stage_blocks=None,
    name: str = "transformer",
    header=None,
):
    """The transformer in `folder` (the component `name`: Wan 2.2 A14B's second expert is transformer_2),
    quantized block by block as it is read (a PipeFusion stage: its blocks)."""
    model = empty_model(folder, "diffusers", class_name, dtype)
    rename = keep_stage(model, class_name, stage_blocks) if stage_blocks is not None else None
    adapter = FAMILIES[class_name]
    lists = [(attribute, getattr(model, attribute)) for attribute in adapter.block_lists]
    return load_quantized(model, "diffusers", folder, dtype, device, quantization, name, lists, rename, header)


def load_quantized_text_encoder(folder: Path, class_name: str, dtype, device, quantization, name: str, header=None):
    """A transformers text encoder quantized layer by layer as it is read (its repeated layers: the same
    lists sharded weights cut, models.sharded_weights.repeated_layers)."""
    from .models.sharded_weights import repeated_layers

    model = empty_model(folder, "transformers", class_name, dtype)
    rename = transformers_key_renaming(model)
    return load_quantized(
        model, "transformers", folder, dtype, device, quantization, name, repeated_layers(model), rename, header
    )


# ---- which components a rank builds itself ----------------------------------------------------------------------


def stage_blocks(model: ModelFolder, config, mesh, name: str = "transformer") -> tuple[int, int]:
    """[start, stop) of the blocks of transformer `name` (transformer_2: Wan 2.2 A14B's second expert) this rank's
    PipeFusion stage holds, from its config as the load's ModelFolder read it."""
    adapter = FAMILIES[model.index[name][1]]
    return config.stage_ranges(adapter.num_blocks(model.configs[name]))[mesh.coords[PIPEFUSION]]


def load_own_components(
    model: ModelFolder,
    config,
    mesh,
    dtype,
    device,
    *,
    sharding: bool,
    quantized=None,
    on_host=(),
    offloaded: bool = False,
    cache=None,
    compile=False,
    controls=None,
) -> dict:
    """{name: module} of the components this rank builds from the files itself, each reading only what it keeps
    (the headers `model` parsed); load_pipeline hands these to diffusers' from_pretrained, which loads the rest
    whole (an image encoder, a ControlNet, the VAE), by the role the folder gives each component:
      - quantized ones (`quantized`: quantization.resolve's), block by block (load_quantized_components); with
        `offloaded` (offload_blocks) the transformers in host memory, never whole on the device;
      - with `sharding`, the transformer and the expert (Wan 2.2 A14B's two alike) parallelized and sharded, then
        this rank's rows read (`cache`, `compile`, `controls`: parallelize's), and every text encoder not kept
        `on_host`;
      - under PipeFusion without sharding, each transformer's stage: its own blocks and the rest."""
    folder, index, header = model.path, model.index, model.header
    loaded = load_quantized_components(model, config, mesh, dtype, device, quantized, offloaded) if quantized else {}
    parallel = dict(cache=cache, compile=compile, controls=controls)
    for name in model.named(TRANSFORMER, EXPERT):
        if name in loaded:
            continue
        if sharding:
            loaded[name] = load_sharded_transformer(
                folder / name, index[name][1], config, mesh, dtype, device, header, **parallel
            )
        elif config.pipefusion > 1:
            blocks = stage_blocks(model, config, mesh, name)
            loaded[name] = load_stage_transformer(
                folder / name, index[name][1], blocks, dtype, "cpu" if offloaded else device, header
            )
    for name in model.text_encoders if sharding else ():
        if name not in on_host and name not in loaded:
            loaded[name] = load_sharded_text_encoder(folder / name, index[name][1], mesh, dtype, device, header)
    return loaded


def load_quantized_components(model: ModelFolder, config, mesh, dtype, device, quantized, offloaded=False) -> dict:
    """The components `quantized` names, each built empty and filled block by block, every block quantized
    as soon as it is read (load_quantized): the transformer and the expert (a PipeFusion stage: its blocks; in
    host memory when `offloaded`) and the text encoders. Anything else is refused by name."""
    loaded, roles = {}, model.roles
    for name in quantized.configs:
        class_name, sub = model.index[name][1], model.path / name
        if roles[name] in (TRANSFORMER, EXPERT):
            blocks = stage_blocks(model, config, mesh, name) if config.pipefusion > 1 else None
            loaded[name] = load_quantized_transformer(
                sub, class_name, dtype, "cpu" if offloaded else device, quantized, blocks, name, model.header
            )
        elif roles[name] == TEXT_ENCODER:
            loaded[name] = load_quantized_text_encoder(sub, class_name, dtype, device, quantized, name, model.header)
        else:
            raise QuantizationError(
                f"{name} ({class_name}) is not quantized by xdit_lab: it quantizes the transformer and the text "
                f"encoders as it loads them; leave {name} out of the quantization's components"
            )
    return loaded
