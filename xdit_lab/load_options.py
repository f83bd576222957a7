"""LoadOptions: everything load_pipeline takes besides the folder, the ParallelConfig and the mesh, and what it refuses.

    options = LoadOptions(shard_weights=True, on_host=("text_encoder_2",))
    options = LoadOptions(offload_blocks=2)    # the transformer in host memory, 2 blocks at a time on the device
    options.problems(recipe, folder, config)   # [] when load_pipeline takes them; else every refusal, a sentence each
    pipe = load_pipeline("path/to/flux", ParallelConfig(ulysses=2), options)

ParallelConfig is half of what a user chooses (the degrees) and says with `problems()` what it breaks; LoadOptions
is the other half (dtype, cache, compile, sharded, host-placed, quantized or adapted weights, another pipeline
class of the family) and says the same way what the model in `folder` refuses, before a weight is read:

    the pipeline class      another family's, or one xdit_lab does not run
    cache, compile          an unknown compile backend, compile with PipeFusion, a StepCache on a family
                            that has none yet or under the async schedule (option_problems, which parallelize
                            asks too: accelerations.py)
    the refusal table       what a pipeline's components or class do not run with (families/refusals.py, which the
                            planner reads to leave out the rows load_pipeline would refuse)
    on_host                 names that are not the folder's text encoders (by their role)
    offload_blocks          not a whole number; with sharded weights on several ranks, or with compile
    quantization            no such scheme or mapping (quantization.resolve); with shard_weights on several ranks
    lora                    an entry of the wrong form, a file that is not there, a pipeline with no LoRA loader,
                            adapters kept unfused, adapters on sharded or quantized weights
    tp                      a family without a tp plan; with quantization, which parallelize does not compose
                            it with yet (families/tp_plan.option_refusals)

Each sentence is a `Refusal`, a str that also knows the exception load_pipeline raises it as (ParallelConfigError,
ValueError, QuantizationError, LoraError), so that load_pipeline raises every sentence at once, as the first one's
kind. shard_weights on one rank is no refusal: load_pipeline warns that there is nothing to shard.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .accelerations import StepCache, option_problems, sea_cache_load_problems
from .config import ParallelConfig, ParallelConfigError
from .families import RECIPES, recipe_for
from .families.refusals import load_refusals, refusal_message
from .lora import LoraError
from .model_folder import EXPERT, TRANSFORMER
from .quantization import QuantizationError

if TYPE_CHECKING:
    from .families.recipe import Recipe
    from .model_folder import ModelFolder
    from .quantization import Quantization


class Refusal(str):
    """One sentence of LoadOptions.problems(); `error` is the exception load_pipeline raises it as."""

    error: type[Exception]

    def __new__(cls, sentence: str, error: type[Exception] = ParallelConfigError) -> Refusal:
        refusal = super().__new__(cls, sentence)
        refusal.error = error
        return refusal


@dataclass(frozen=True)
class LoadOptions:
    """How load_pipeline loads a folder besides its ParallelConfig; each field is load_pipeline's keyword of that
    name (see its docstring), with the same default. `on_host` may be one name; it is kept as a tuple."""

    torch_dtype: object = "auto"  # "auto" (bfloat16 on a GPU, float32 on a CPU), a torch.dtype or its name
    memory_limit_bytes: int | None = None
    progress: bool = True
    cache: object = None  # a StepCache, or one of diffusers' cache configurations (accelerations.py)
    compile: bool | str = False
    shard_weights: bool = False
    on_host: tuple[str, ...] = ()
    offload_blocks: int | None = None  # N: the transformer's blocks in host memory, N at a time on the device
    quantization: object = None  # "int8", "float8", or diffusers' PipelineQuantizationConfig / TorchAoConfig
    lora: object = None  # [(path_or_state_dict, scale[, "transformer_2"]), ...]
    fuse_lora: bool = True
    pipeline_class: str | None = None
    controls: object = None  # models.Controls: deliberately wrong variants for tests and lessons; none by default

    def __post_init__(self):
        if isinstance(self.on_host, str):
            object.__setattr__(self, "on_host", (self.on_host,))
        elif not isinstance(self.on_host, tuple):
            object.__setattr__(self, "on_host", tuple(self.on_host))

    @classmethod
    def given(cls, options: LoadOptions | None = None, **keywords) -> LoadOptions:
        """`options` (default: LoadOptions()) with the fields `keywords` name replaced; a keyword that is no
        field is refused by name, with the field it most likely meant (TypeError, as a call's unknown keyword)."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = [name for name in keywords if name not in fields]
        if unknown:
            raise TypeError(unknown_keywords(unknown, fields))
        return dataclasses.replace(options if options is not None else cls(), **keywords)

    # ---- what the model in a folder refuses ------------------------------------------------------------------
    def problems(self, recipe: Recipe, folder: ModelFolder, config: ParallelConfig | None = None) -> list[Refusal]:
        """Every refusal of these options for the pipeline in `folder` (a ModelFolder, read as on disk) of family
        `recipe`, as sentences; empty when load_pipeline takes them. The rules that depend on the degrees (PipeFusion
        and its async schedule, sharding over several ranks, compile under PipeFusion) read `config`, the load's
        ParallelConfig; None is one rank, serial."""
        config = ParallelConfig() if config is None else config
        found = [
            Refusal(sentence, error)
            for sentence, error in option_problems(config, folder.adapter, cache=self.cache, compile=self.compile)
        ]
        wrong_class = self._pipeline_class_problems(recipe, folder)
        pipeline_class = (
            folder.pipeline_class if wrong_class else self.pipeline_class_of(folder)
        )  # what else is said of
        found += wrong_class
        found += self._refused(recipe, pipeline_class, folder, config)
        sea = sea_cache_load_problems(self.cache, folder.adapter, pipeline_class, self.sharding(config))
        found += [Refusal(sentence, ParallelConfigError) for sentence in sea]
        found += self._on_host_problems(folder)
        found += self._offload_problems(config)
        found += self._quantization_problems(folder, config)
        found += self._lora_problems(pipeline_class, folder, config)
        found += self._tp_problems(folder, config)
        return found

    def check(self, recipe: Recipe, folder: ModelFolder, config: ParallelConfig | None = None) -> None:
        """Raise every problem() at once, as the first one's exception; nothing when there is none."""
        found = self.problems(recipe, folder, config)
        if found:
            raise found[0].error("; ".join(found))

    def pipeline_class_of(self, folder: ModelFolder) -> str:
        """The diffusers pipeline class the folder runs as: `pipeline_class`, or the one its index names."""
        return self.pipeline_class or folder.pipeline_class

    def sharding(self, config: ParallelConfig) -> bool:
        """Whether weights are sharded: asked, and on more than one rank (on one there is nothing to shard)."""
        return bool(self.shard_weights) and config.world_size > 1

    @property
    def offloaded(self) -> int | None:
        """The blocks held on the device at once when the transformer is offloaded (offload_blocks), else None."""
        return self.offload_blocks or None

    def quantized(self, folder: ModelFolder) -> Quantization | None:
        """The quantization as quantization.resolve reads it for `folder` (None: none asked)."""
        from .quantization import resolve

        return resolve(self.quantization, folder)

    @property
    def adapters(self) -> list[tuple[object, float, str]]:
        """`lora` as [(path or state dict, scale, transformer)], once problems() found nothing wrong with it: a path
        or a state dict alone has scale 1, an entry of two goes into "transformer"."""
        return [
            (Path(source).expanduser() if isinstance(source, (str, Path)) else source, float(scale), into)
            for _, source, scale, into in _lora_entries(self.lora)
        ]

    def to_record(self) -> dict:
        """The options as a run's records keep them (report.json, run.json): JSON values, each field by its name;
        a dtype by its name, a StepCache by its threshold, method and its method's fields, a diffusers cache configuration by its class
        and repr, a LoRA state dict as "a state dict"."""
        cache = self.cache
        return dict(
            torch_dtype=self.torch_dtype if isinstance(self.torch_dtype, str) else str(self.torch_dtype),
            memory_limit_bytes=self.memory_limit_bytes,
            progress=self.progress,
            cache=None
            if cache is None
            else cache.record()
            if isinstance(cache, StepCache)
            else dict(diffusers=type(cache).__name__, settings=repr(cache)),
            compile=self.compile,
            shard_weights=self.shard_weights,
            on_host=list(self.on_host),
            offload_blocks=self.offload_blocks,
            quantization=self.quantization
            if self.quantization is None or isinstance(self.quantization, str)
            else repr(self.quantization),  # fmt: skip
            lora=[
                [str(source) if isinstance(source, (str, Path)) else "a state dict", scale, into]
                for _, source, scale, into in _lora_entries(self.lora)
            ],
            fuse_lora=self.fuse_lora,
            pipeline_class=self.pipeline_class,
            controls=None if self.controls is None else repr(self.controls),
        )

    # ---- the rules, by option --------------------------------------------------------------------------------
    def _pipeline_class_problems(self, recipe: Recipe, folder: ModelFolder) -> list[Refusal]:
        asked, holds = self.pipeline_class, folder.pipeline_class
        if asked is None or asked == holds:
            return []
        if asked not in RECIPES:
            return [Refusal(f"xdit_lab does not run {asked}; supported pipelines: {', '.join(RECIPES)}", ValueError)]
        other = recipe_for(asked, folder.index)
        if other is recipe:
            return []
        runs = ", ".join(name for name in RECIPES if recipe_for(name, folder.index) is recipe)
        if other.family == recipe.family:  # Flux.2 [dev] and klein: one family, other text encoders
            said = f"runs other components than {folder.path}'s {holds} (another {recipe.family} pipeline)"
        else:
            said = f"is a {other.family} pipeline, and {folder.path} holds a {recipe.family} one ({holds})"
        return [Refusal(f"pipeline_class={asked!r} {said}; name one of {runs}", ValueError)]

    def _refused(self, recipe: Recipe, pipeline_class: str, folder: ModelFolder, config) -> list[Refusal]:
        """The refusal table's reasons for what is asked, one sentence per reason with every asked argument it
        covers."""
        asked = dict(
            pipefusion=config.pipefusion > 1,
            pipefusion_async=config.pipefusion > 1 and config.pipefusion_schedule == "async",
            shard_weights=self.sharding(config),
            quantization=self.quantization is not None,
            compile=bool(self.compile),
            cache=self.cache is not None,
        )
        refused = load_refusals(recipe, pipeline_class, folder.components)
        hits = [what for what, given in asked.items() if given and what in refused]
        reasons = dict.fromkeys(refused[what] for what in hits)  # each once, in the order asked
        return [Refusal(refusal_message(refused, [w for w in hits if refused[w] == reason])) for reason in reasons]

    def _on_host_problems(self, folder: ModelFolder) -> list[Refusal]:
        known = folder.text_encoders
        wrong = [name for name in self.on_host if name not in known]
        if not wrong:
            return []
        return [
            Refusal(
                f"on_host names {', '.join(map(repr, wrong))}, which {folder.path.name} has no text encoder called: "
                f"its text encoders are {', '.join(map(repr, known)) or 'none'} (the transformer and the VAE stay on "
                f"the device)",
                ValueError,
            )
        ]

    def _offload_problems(self, config) -> list[Refusal]:
        """The transformer offloaded with diffusers' group offloading (models/offload.py): a whole number of blocks,
        with what keeps its weights where diffusers' hooks can move them. (Every family with a pipeline takes
        diffusers' group offloading; offload_blocks refuses a transformer that does not, DiT's, by name.)"""
        n = self.offload_blocks
        if n is None:
            return []
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            return [
                Refusal(
                    f"offload_blocks is the number of the transformer's blocks on the device at once (the rest in "
                    f"host memory), a whole number >= 1, or 0 or None for none offloaded; got {n!r}",
                    ValueError,
                )
            ]
        if n == 0:
            return []
        found = []
        if self.sharding(config):
            found.append(
                "offload_blocks with shard_weights: FSDP2 keeps 1/N of every block on a rank and gathers it whole to "
                "the device as it runs; offloading those shards as well would move each block twice (host to "
                "device, then the all-gather); use one of the two (xdit-lab plan --model says which fits)"
            )
        if self.compile:
            found.append(
                "offload_blocks with compile: diffusers' group offloading moves each group's weights in functions "
                "torch.compile does not trace (torch.compiler.disable), so the one compiled graph would break at "
                "every group; use one of the two"
            )
        return [Refusal(sentence, ValueError) for sentence in found]

    def _tp_problems(self, folder: ModelFolder, config) -> list[Refusal]:
        """tp where the family has no plan, or with what parallelize does not compose it with yet (its own rules)."""
        if config.tp == 1:
            return []
        import diffusers

        from .families.tp_plan import header_problems, model_plan, option_refusals

        model_class = getattr(diffusers, folder.transformer.class_name)
        try:
            model_plan(model_class, folder.adapter)
        except ParallelConfigError as error:  # the family has no plan
            return [Refusal(str(error))]
        weights = folder.transformer
        tensors = [(t.name, t.shape) for t in (*weights.root, *(t for block in weights.blocks for t in block))]
        found = [Refusal(s) for s in header_problems(tensors, model_class, folder.adapter, config.tp)]
        found += [Refusal(sentence, ValueError) for sentence in option_refusals(config, quantization=self.quantization)]
        return found

    def _quantization_problems(self, folder: ModelFolder, config) -> list[Refusal]:
        if self.quantization is None:
            return []
        found = []
        try:
            self.quantized(folder)
        except QuantizationError as error:
            found.append(Refusal(str(error), QuantizationError))
        if self.sharding(config):
            found.append(
                Refusal(
                    "quantization with shard_weights: torchao's quantized weights (Int8Tensor, Float8Tensor) do not "
                    "implement FSDP2's all-gather extensions (fsdp_pre_all_gather), so a quantized block cannot be "
                    "sharded and gathered; use one of the two (xdit-lab plan --model says which fits)",
                    QuantizationError,
                )
            )
        return found

    def _lora_problems(self, pipeline_class: str, folder: ModelFolder, config) -> list[Refusal]:
        """An adapter is fused into whole full-precision weights by diffusers' loaders (lora.py): each entry's form
        and file, then what it cannot go with."""
        if self.lora is None or self.lora == []:
            return []
        import diffusers

        transformers = folder.named(TRANSFORMER, EXPERT)
        found = []
        for entry, source, scale, into in _lora_entries(self.lora):
            if into not in transformers:
                found.append(
                    f"LoRA entry {entry!r:.80}: its third element names the transformer it goes into, one of "
                    f"{', '.join(map(repr, transformers))} in this folder; got {into!r}"
                )
            if not isinstance(source, (str, Path, dict)):
                found.append(
                    f"lora takes [(path_or_state_dict, scale), ...]; got {entry!r:.80}: give a LoRA file or folder, "
                    f"or its state dict, each with a scale"
                )
            if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
                found.append(f"a LoRA's scale must be a number (1.0: as trained); got {scale!r}")
            if isinstance(source, (str, Path)) and not Path(source).expanduser().exists():
                found.append(f"LoRA {source}: no such file or folder")
        if not hasattr(getattr(diffusers, pipeline_class, None), "load_lora_weights"):
            found.append(
                f"{pipeline_class} has no LoRA loader in diffusers (load_lora_weights), so its adapters cannot be "
                f"read as diffusers reads them; fuse the adapter into the folder's weights first"
            )
        if not self.fuse_lora:
            found.append(
                "fuse_lora=False (adapters kept beside the weights, switchable) is not supported: the strategies' "
                "hooks, PipeFusion's stages and compile take plain linear layers; keep fuse_lora=True"
            )
        sharded, quantized = self.sharding(config), self.quantization is not None
        if sharded or quantized:
            found.append(
                f"lora with {'shard_weights' if sharded else 'quantization'}: an adapter is fused into whole "
                f"full-precision weights, which a{' sharded' if sharded else ' quantized'} rank does not hold; fuse "
                f"it into the folder's weights first (diffusers: pipe.load_lora_weights, pipe.fuse_lora, "
                f"save_pretrained)"
            )
        return [Refusal(sentence, LoraError) for sentence in found]


def _lora_entries(lora):
    """(entry as given, source, scale, transformer) of each of `lora`'s entries, unchecked."""
    if lora is None or lora == []:
        return
    for entry in lora if isinstance(lora, list) else [lora]:
        if isinstance(entry, tuple) and len(entry) in (2, 3):
            source, scale, into = (*entry, "transformer")[:3]
        else:
            source, scale, into = entry, 1.0, "transformer"
        yield entry, source, scale, into


def unknown_keywords(unknown, fields) -> str:
    """A clear error for keywords load_pipeline does not take (before, they went to diffusers' from_pretrained,
    which ignored them: `shard_wieghts=True` ran replicated without a word), with the field each most likely meant."""
    lines = []
    for name in unknown:
        close = difflib.get_close_matches(name, fields, n=1)
        lines.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"load_pipeline() got keyword argument(s) it does not know: {', '.join(lines)}; it takes the folder, the "
        f"ParallelConfig, options (a LoadOptions), mesh, and LoadOptions' fields as keywords: {', '.join(fields)}"
    )
