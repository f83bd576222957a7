"""Quantized weights: torchao's weight-only schemes, named as diffusers' own quantization config names them,
applied block by block as the weights are read, and counted by the memory plan before a byte is read.

    load_pipeline(folder, config, quantization="int8")       # the transformer and the text encoders
    load_pipeline(folder, config, quantization=PipelineQuantizationConfig(quant_mapping={
        "transformer": diffusers.TorchAoConfig(Float8WeightOnlyConfig())}))

A scheme replaces every nn.Linear weight W [out, in] of a component with torchao's tensor subclass: the
weight in one byte per element and a scale (and an int8 zero point) per output row; biases, norms and
embeddings keep the load dtype. Per weight, as loaded (torchao 0.18, measured in tests/test_quantization.py):

    scheme   torchao config            bytes of W [out, in]
    int8     Int8WeightOnlyConfig      out·in (int8)    + out·4 (float32 scale) + out·1 (int8 zero point)
    float8   Float8WeightOnlyConfig    out·in (e4m3fn)  + out·4 (float32 scale)

The quantizing is torchao's own (`quantize_`), the same call diffusers' torchao backend makes for each
linear layer; no kernel is written here. What is ours is when: the loader (loading.py) reads one block's
weights, quantizes that block, and moves on, so a rank never holds more than one block in full precision
beside the quantized ones (xDiT quantizes after the whole model is on the GPU, so its loading peak stays at
full size).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

# the named schemes: torchao's config class, and the bytes of one quantized row beside its `in` elements
SCHEMES = {
    "int8": ("Int8WeightOnlyConfig", 4 + 1),  # a float32 scale and an int8 zero point per output row
    "float8": ("Float8WeightOnlyConfig", 4),  # a float32 scale per output row
}
DEFAULT_COMPONENTS = ("transformer", "text_encoder")  # and transformer_2, every text_encoder_N: see resolve


TRANSFORMERS = ("transformer", "transformer_2")  # the transformer, and Wan 2.2 A14B's second expert


class QuantizationError(ValueError):
    """A quantization that cannot be applied as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Quantization:
    """What to quantize and how: a torchao config per component, and the linear layers each leaves alone."""

    configs: dict  # component name -> torchao AOBaseConfig (an instance)
    scheme: str | None = None  # the named scheme, when one was asked for (its bytes are planned)
    skip: dict | None = None  # component name -> module names not to convert (diffusers' modules_to_not_convert)

    def covers(self, name: str) -> bool:
        return name in self.configs

    def config_for(self, name: str):
        return self.configs[name]

    def skipped(self, name: str) -> list[str] | None:
        """The component's modules_to_not_convert as given (None: the library's defaults)."""
        found = (self.skip or {}).get(name)
        return None if found is None else list(found)


def resolve(quantization, folder) -> Quantization | None:
    """`quantization` as load_pipeline takes it, for the pipeline in `folder` (the load's ModelFolder: its
    `components`, and `quantizable`, those its roles name the transformer, the expert and the text encoders):
    None; a named scheme ("int8", "float8") for the transformer and every text encoder; or diffusers'
    PipelineQuantizationConfig with a torchao config per component (`quant_mapping`), or one diffusers
    TorchAoConfig for the transformer and the text encoders."""
    if quantization is None:
        return None
    components, targets = folder.components, folder.quantizable
    if isinstance(quantization, str):
        if quantization not in SCHEMES:
            raise QuantizationError(
                f"no quantization scheme {quantization!r}: the named schemes are {', '.join(SCHEMES)} (weight-only, "
                f"torchao), or pass diffusers' PipelineQuantizationConfig with torchao configs"
            )
        config = _torchao_config(SCHEMES[quantization][0])
        return Quantization({name: config for name in targets}, scheme=quantization)
    mapping = getattr(quantization, "quant_mapping", None)
    if mapping is None and hasattr(quantization, "quant_type"):  # one TorchAoConfig for the default components
        mapping = {name: quantization for name in targets}
    if not mapping:
        raise QuantizationError(
            f"{type(quantization).__name__} is not a quantization load_pipeline takes: pass a named scheme "
            f"({', '.join(SCHEMES)}), a diffusers TorchAoConfig, or a PipelineQuantizationConfig whose quant_mapping "
            f"gives each component a TorchAoConfig (diffusers' for the transformer, transformers' for text encoders)"
        )
    configs, skip = {}, {}
    for name, entry in mapping.items():
        if name not in components:
            raise QuantizationError(
                f"the quantization names {name!r}, which this pipeline does not have: its components are "
                f"{', '.join(components)}"
            )
        quant_type = getattr(entry, "quant_type", None)
        if quant_type is None or isinstance(quant_type, str) or "torchao" not in type(quant_type).__module__:
            raise QuantizationError(
                f"{name}'s quantization config is {type(entry).__name__}; xdit_lab applies torchao configs only "
                f"(TorchAoConfig(Int8WeightOnlyConfig()), ...), which it quantizes block by block as it loads"
            )
        if isinstance(quant_type, _per_module_configs()) or getattr(entry, "include_input_output_embeddings", False):
            raise QuantizationError(
                f"{name}'s TorchAoConfig maps module names to configs or quantizes embeddings; xdit_lab applies one "
                f"config to a component's linear layers: give each component one torchao config"
            )
        configs[name] = quant_type
        skip[name] = getattr(entry, "modules_to_not_convert", None)  # None: the library's default skips
    defaults = all(patterns is None for patterns in skip.values())  # else the plan cannot name what stays whole
    return Quantization(configs, scheme=_scheme_of(configs) if defaults else None, skip=skip)


def _per_module_configs() -> tuple[type, ...]:
    """torchao's per-module-name config classes, which xdit_lab does not apply (one config per component)."""
    import torchao.quantization as ao

    return tuple(getattr(ao, name) for name in ("FqnToConfig", "ModuleFqnToConfig") if hasattr(ao, name))


def _torchao_config(class_name: str):
    try:
        import torchao.quantization as ao
    except ImportError as error:
        raise QuantizationError(
            f"quantization needs torchao (pip install torchao): {error}; or load without quantization"
        ) from None
    return getattr(ao, class_name)()


def _scheme_of(configs: dict) -> str | None:
    """The named scheme every component's config is, if one is (its bytes can then be planned)."""
    names = {type(config).__name__ for config in configs.values()}
    for scheme, (class_name, _) in SCHEMES.items():
        if names == {class_name}:
            return scheme
    return None


def quantized_linears(model: torch.nn.Module, library: str, skip=None) -> frozenset[str]:
    """The weights (qualified names, "blocks.0.attn.to_q.weight") a library's own torchao quantizer would
    replace in `model`: every nn.Linear's weight but those its rules leave alone, so that our block-by-block
    load quantizes exactly what `from_pretrained(..., quantization_config=TorchAoConfig(...))` quantizes.
      - diffusers (TorchAoHfQuantizer.check_if_quantized_param): `skip` (modules_to_not_convert) and the
        class's _keep_in_fp32_modules, each matching a name it is a dotted part of ("time_embedder." in
        "condition_embedder.time_embedder.linear_1.weight");
      - transformers (TorchAoHfQuantizer.param_needs_quantization): its own get_modules_to_not_convert
        (with skip=None: the tied weights, the output embedding and the last parameter, so CLIP's
        text_projection and a tied lm_head stay as they are) and should_convert_module's matching."""
    weights = [
        f"{name}.weight" if name else "weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    ]
    if library == "transformers":
        from transformers.quantizers.base import HfQuantizer
        from transformers.quantizers.quantizers_utils import should_convert_module

        patterns = HfQuantizer.get_modules_to_not_convert(model, skip, getattr(model, "_keep_in_fp32_modules", None))
        return frozenset(w for w in weights if should_convert_module(w, patterns))
    patterns = [*(skip or ()), *(getattr(type(model), "_keep_in_fp32_modules", None) or ())]
    return frozenset(w for w in weights if not any(f"{p}." in w or p == w for p in patterns))


def quantize_block(module: torch.nn.Module, config, chosen: frozenset[str], prefix: str = "") -> None:
    """torchao's quantize_ on the nn.Linear layers of `module` whose weight, named `prefix` + its name in
    `module`, is in `chosen` (quantized_linears of the whole model)."""
    from torchao.quantization import quantize_

    def picked(layer, name):
        return isinstance(layer, torch.nn.Linear) and f"{prefix}{name}.weight" in chosen

    quantize_(module, config, filter_fn=picked)


def quantized_weight_bytes(shape, scheme: str) -> int:
    """Bytes of one nn.Linear weight [out, in] under a named scheme (the table above)."""
    out, inner = shape[0], int(torch.Size(shape[1:]).numel())
    return out * inner + out * SCHEMES[scheme][1]


def quantized_form(tensor: torch.Tensor) -> str | None:
    """The scheme a parameter is stored in ("int8", "float8"; another torchao subclass by its class name),
    or None for a plain (or DTensor) parameter."""
    kind = type(tensor)
    if not kind.__module__.startswith("torchao"):
        return None
    return {"Int8Tensor": "int8", "Float8Tensor": "float8"}.get(kind.__name__, kind.__name__)


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, a torchao subclass by its inner tensors (its own numel counts the whole weight
    at the load dtype), a DTensor by its local part."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


# ---- three log lines that torchao's presence prints on every pipeline load, none of them about what runs here --


# (logger, a phrase of its message): for torchao 0.18 with torch 2.13, diffusers 0.42. torchao's wheels carry
# CUDA-only kernels (mxfp8, cutlass) that fail to load on a CPU-only torch, and are never called by the weight-only
# schemes; diffusers' torchao backend looks up tensor classes (NF4Tensor, UintxTensor) that 0.18 moved, which only
# matters for checkpoints serialized by torchao, not read here; torchao registers its enums with torch.compile the
# old way. With torchao installed they print on the first load of any pipeline, quantized or not, into every notebook.
FALSE_ALARMS = (
    ("torchao", "Failed to load "),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile"),
)


class _DropFalseAlarm(logging.Filter):
    def __init__(self, phrase: str):
        super().__init__()
        self.phrase = phrase

    def filter(self, record: logging.LogRecord) -> bool:
        return self.phrase not in record.getMessage()


def drop_false_alarms() -> None:
    """Filter the FALSE_ALARMS out of their loggers (each by a phrase of its message, every other record kept);
    run once on import of xdit_lab, before any of those loggers is used. Idempotent."""
    for name, phrase in FALSE_ALARMS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropFalseAlarm) and f.phrase == phrase for f in logger.filters):
            logger.addFilter(_DropFalseAlarm(phrase))
