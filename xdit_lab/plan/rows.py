"""The rows of a plan: what one rank holds under one configuration, with whole, sharded or offloaded weights, the
text encoders on the GPU, sharded or on the host, quantized or not (plan_row: a FitRow, from the weight planner and
the request terms), and every such row for N GPUs that load_pipeline takes, ranked (plan_model). A row is a load:
its configuration and `row.load_options()`, which LoadOptions.problems() accepts (the rows it refuses are left
out, by the same rules). A load asks plan_row for its own configuration and placement (load.plan_memory): the row
the command prints for them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import GRID, CostEstimate, ParallelConfig
from ..families import CONTROLNETS
from ..families.refusals import REFUSABLE, load_refusals, refusal_message
from ..families.tp_plan import has_plan
from ..load_options import LoadOptions
from ..model_folder import ModelFolder, read_model_folder
from ..quantization import SCHEMES
from ..vae import PLANAR_VAES
from .terms import (
    UNPLANNED_DECODES,
    VIDEO_DECODE_PEAKS,
    Call,
    RequestShape,
    decode_bands,
    make_call,
    planned_decode_peak,
    request_shape,
    stale_kv,
)
from .weights import held_weights

# Link bandwidths the planner turns traffic into seconds with (one direction, per GPU, peak; NCCL
# reaches some 80% of them):
NVLINK_BYTES_PER_S = 450e9  # NVLink 4 (H100 SXM): 900 GB/s per GPU both ways, NVIDIA's H100 datasheet
PCIE_BYTES_PER_S = 32e9  # PCIe 4.0 x16: 16 GT/s × 16 lanes × 128/130 ≈ 31.5 GB/s (PCI-SIG), 24 GB cards' link
LINKS = {"NVLink": NVLINK_BYTES_PER_S, "PCIe": PCIE_BYTES_PER_S}

PLACEMENTS = ("gpu", "sharded", "host")  # where text encoders live; ranked in this order at equal cost
# how load_pipeline can hold the weights, as (shard_weights, the text encoders' placement): shard_weights shards the
# transformer and every text encoder it does not keep on_host, so "text encoders sharded, the transformer whole"
# and "the transformer sharded, text encoders whole" are no load's, and no row's
HOLDINGS = ((False, "gpu"), (True, "sharded"), (False, "host"), (True, "host"))
GB = 10**9


@dataclass(frozen=True)
class PlannedRequest:
    """What every row of a plan was planned for (shared by the rows)."""

    folder: Path
    pipeline_class: str
    transformer_class: str
    dtype: str
    height: int
    width: int
    frames: int
    prompts: int
    branches: int
    image_tokens: int
    transformer_bytes: int
    notes: tuple[str, ...]
    quantize: str | None = None  # a named scheme (quantization.SCHEMES) on the transformer and text encoders
    text_encoders: tuple[str, ...] = ()  # the components the rows' text_encoders placement moves
    offload_blocks: int | None = None  # the transformer's blocks on the host, this many at a time on the GPU

    def describe(self) -> str:
        frames = f", {self.frames} latent frames" if self.frames > 1 else ""
        quantized = f", its linear weights {self.quantize}" if self.quantize else ""
        offloaded = f", {offloaded_words(self.offload_blocks)}" if self.offload_blocks else ""
        return (
            f"{self.pipeline_class} ({self.transformer_class}, {self.transformer_bytes / GB:.1f} GB in {self.dtype}"
            f"{quantized}{offloaded}) "
            f"at {self.height}×{self.width}{frames}: {self.image_tokens:,} image tokens, {self.prompts} prompt(s) × "
            f"{self.branches} branch(es)"
        )


@dataclass
class FitRow:
    """One way to run the model on world_size GPUs and what a rank holds then (bytes, by term)."""

    config: ParallelConfig
    shard_weights: bool
    text_encoders: str  # "gpu", "sharded" or "host"
    weights: dict[str, int]  # per component, on this rank's GPU
    gather: int
    latents: int
    conditioning: int
    stale_kv: int
    decode_peak: int | None  # None: no closed form (see unknown)
    gpu_memory_bytes: int
    cost: CostEstimate
    activation_traffic: int  # bytes a rank sends per step (sequence parallelism, PipeFusion)
    gather_traffic: int  # bytes a rank all-gathers per step (sharded weights)
    encode_gather_traffic: int  # bytes a rank all-gathers per request (sharded text encoders)
    host_bytes: int  # text encoders (and an offloaded transformer) kept in host memory by this rank's process
    quantize: str | None = None  # the transformer's and text encoders' linear weights in this scheme
    offload_blocks: int | None = None  # the transformer's blocks in host memory, this many at a time on the GPU
    offload_traffic: int = 0  # bytes host to GPU per step with offload_blocks (every weight once per call)
    unknown: tuple[str, ...] = ()
    bounds: tuple[str, ...] = ()
    request: PlannedRequest | None = field(default=None, repr=False, compare=False)

    @property
    def terms(self) -> dict[str, int | None]:
        return {
            **{f"weights: {name}": size for name, size in self.weights.items()},
            "gather buffer": self.gather,
            "latents": self.latents,
            "conditioning": self.conditioning,
            "stale K/V": self.stale_kv,
            "decode peak": self.decode_peak,
        }

    @property
    def per_rank_bytes(self) -> int:
        """The sum of the known terms (the unknown ones are named in `unknown`)."""
        return sum(size for size in self.terms.values() if size is not None)

    @property
    def fits(self) -> bool:
        return self.per_rank_bytes <= self.gpu_memory_bytes

    @property
    def traffic_per_step(self) -> int:
        return self.activation_traffic + self.gather_traffic

    def seconds_per_step(self, bytes_per_s: float) -> float:
        """The step's traffic over one link of `bytes_per_s` (NVLINK_BYTES_PER_S, PCIE_BYTES_PER_S)."""
        return self.traffic_per_step / bytes_per_s

    def name(self) -> str:
        return (
            self.config.short()
            + ("·sharded" if self.shard_weights else "")
            + (f"·{self.quantize}" * bool(self.quantize))
            + (f"·offload{self.offload_blocks}" if self.offload_blocks else "")
        )

    def load_options(self) -> LoadOptions:
        """What to load this row with: `load_pipeline(folder, row.config, row.load_options())`."""
        text_encoders = self.request.text_encoders if self.request is not None else ()
        return load_options_of(
            self.shard_weights, self.text_encoders, self.quantize, text_encoders, self.offload_blocks
        )

    def to_json(self) -> dict:
        return dict(
            config=self.config.short(),
            degrees={d: getattr(self.config, d) for d in GRID},
            num_patches=self.config.patches if self.config.pipefusion > 1 else None,
            shard_weights=self.shard_weights,
            quantize=self.quantize,
            text_encoders=self.text_encoders,
            per_rank_bytes=self.per_rank_bytes,
            gpu_memory_bytes=self.gpu_memory_bytes,
            fits=self.fits,
            terms=self.terms,
            unknown_terms=list(self.unknown),
            bounds=list(self.bounds),
            host_bytes_per_rank=self.host_bytes,
            offload_blocks=self.offload_blocks,
            host_to_gpu_bytes_per_step=self.offload_traffic,
            cost=dataclasses.asdict(self.cost),
            traffic_bytes_per_step=dict(activations=self.activation_traffic, weight_gathers=self.gather_traffic),
            encode_gather_bytes_per_request=self.encode_gather_traffic,
            seconds_per_step={link: self.seconds_per_step(bw) for link, bw in LINKS.items()},
        )


def plan_model(
    folder,
    world_size: int,
    gpu_memory_bytes: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    use_cfg: bool | None = None,
    options: dict | None = None,
    quantize: str | None = None,
    offload_blocks: int | None = None,
) -> list[FitRow]:
    """Every way to run the pipeline in `folder` on `world_size` GPUs of `gpu_memory_bytes` each, what
    one rank holds under each (FitRow), ranked: fitting rows first, then by the cost model with
    FSDP2's gathers (work, then bytes sent per step, then text encoders on the GPU before sharded
    before host, then memory). Reads model_index.json, the configs and the safetensors headers only.

    `height`, `width`: the request's size (default: the folder's call defaults, else the family's).
    `use_cfg`: two branches or one (default: what the family's recipe runs at its default call).
    `options`: the family's call options (max_sequence_length, num_frames, ...).
    `quantize`: a named scheme ("int8", "float8": quantization.SCHEMES) for the linear weights of the transformer
    and the text encoders, as load_pipeline(quantization=...) loads them; its rows shard nothing (torchao's
    quantized tensors have no FSDP2 all-gather: load_pipeline refuses the two together).
    `offload_blocks`: N, the transformer's blocks in host memory and N at a time on the GPU, as
    load_pipeline(offload_blocks=N) loads them; its rows shard nothing (load_pipeline refuses the two together)
    and say the bytes moved from the host per step."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive whole number, got {world_size!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive whole number of prompts, got {batch!r}")
    if not isinstance(gpu_memory_bytes, int) or gpu_memory_bytes < 1:
        raise ValueError(f"gpu_memory_bytes must be a positive whole number of bytes, got {gpu_memory_bytes!r}")
    if quantize is not None and quantize not in SCHEMES:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)} (weight-only, torchao), got {quantize!r}")
    import diffusers

    model = read_model_folder(folder, dtype)
    call = make_call(model, height=height, width=width, batch=batch, use_cfg=use_cfg, options=options)
    shape = request_shape(model, call)
    t = model.transformer.config
    blocks = model.adapter.num_blocks(t)
    # tp's rows where its family has a plan; not with blocks offloaded, whose groups a tp split was never run on
    # and whose rows would count the offloaded weights, not a tp rank's
    splits = has_plan(getattr(diffusers, model.transformer.class_name), model.adapter) and not offload_blocks
    configs = ParallelConfig.options(
        world_size,
        num_heads=model.adapter.attention_shape(t)[0],
        num_layers=blocks,
        seq_len=shape.image_tokens,
        use_cfg=call.branches == 2,
        batch=batch,
        tensor_parallel=splits,
    )
    configs = [c for c in configs if c.pipefusion == 1 or shape.grid[0] >= c.patches]
    # what load_pipeline refuses with this pipeline (two experts, a ControlNet) is not planned
    refused = load_refusals(model.recipe, model.pipeline_class, model.weights)
    if quantize and "quantization" in refused:
        raise ValueError(refusal_message(refused, ["quantization"]))
    if offload_blocks:  # a number that is none, or a transformer diffusers does not offload: as load_pipeline says
        taken = LoadOptions(offload_blocks=offload_blocks).problems(model.recipe, model)
        if taken:
            raise ValueError("; ".join(taken))
    planned = PlannedRequest(
        model.path,
        model.pipeline_class,
        model.transformer.class_name,
        str(dtype).removeprefix("torch."),
        call.height,
        call.width,
        shape.frames,
        call.prompts,
        call.branches,
        shape.image_tokens,
        model.transformer.whole,
        (
            *model.notes, *shape.bounds, *_quantize_notes(quantize), *_offload_notes(offload_blocks),
            *_refused_notes(model, refused),
        ),
        quantize,
        tuple(model.text_encoders),
        offload_blocks or None,
    )  # fmt: skip
    recipe = model.recipe
    rows = []
    for config in configs:
        for shard, placement in HOLDINGS:
            if placement != "gpu" and not model.text_encoders:
                continue  # no text encoder to place: the whole and sharded rows say it all
            if shard and world_size // (config.pipefusion * config.tp) == 1:
                continue  # nothing to shard: each rank of a stage (of a tp coordinate) is alone with its weights
            options = load_options_of(shard, placement, quantize, model.text_encoders, offload_blocks)
            if options.problems(recipe, model, config):
                continue  # refused by load_pipeline (LoadOptions.problems): see _quantize_notes, _refused_notes
            rows.append(
                plan_row(
                    model, config, shard=shard, placement=placement, quantize=quantize, call=call, shape=shape,
                    gpu_memory_bytes=gpu_memory_bytes, planned=planned, offload=offload_blocks,
                )
            )  # fmt: skip
    return sorted(rows, key=fit_rank_key)


def load_options_of(
    shard: bool, placement: str, quantize: str | None, text_encoders, offload: int | None = None
) -> LoadOptions:
    """The LoadOptions that hold the weights as a row says: load_pipeline(folder, row.config, these)."""
    on_host = tuple(text_encoders) if placement == "host" else ()
    return LoadOptions(shard_weights=shard, on_host=on_host, quantization=quantize, offload_blocks=offload or None)


def offloaded_words(blocks_at_once: int) -> str:
    """How a plan names offload_blocks=N."""
    return f"transformer blocks on the host, {blocks_at_once} at a time on the GPU"


def _offload_notes(offload: int | None) -> tuple[str, ...]:
    if not offload:
        return ()
    return (
        f"offload_blocks {offload}: {offloaded_words(offload)} (diffusers' group offloading); GB/rank counts the "
        f"transformer's root and its largest group of {offload} block(s), and every weight crosses from the host "
        f"once per transformer call (a PipeFusion stage's blocks once per patch): the column GB in (--json: "
        f"host_to_gpu_bytes_per_step)",
        "no sharded rows with offload_blocks: FSDP2's shards would move twice (host to GPU, then the all-gather), "
        "so load_pipeline refuses the two together; plan without --offload-blocks to see them",
    )


def fit_rank_key(row: FitRow) -> tuple:
    """Fitting rows first; then least work, least traffic per step (FSDP2's gathers included, and the weights
    brought from the host with offload_blocks), text encoders on the GPU before sharded before host (the encode's
    speed), least memory, simplest."""
    config = row.config
    return (
        not row.fits,
        round(row.cost.work_fraction, 9),
        row.traffic_per_step + row.offload_traffic,
        PLACEMENTS.index(row.text_encoders),
        row.per_rank_bytes,
        sum(getattr(config, d) > 1 for d in GRID),
        config.dp,
        -config.cfg,
        -config.ulysses,
        -config.ring,
    )


def smallest_fit(rows: list[FitRow]) -> FitRow:
    """The row that needs the least GPU memory: what to buy when nothing fits."""
    return min(rows, key=lambda row: (row.per_rank_bytes, fit_rank_key(row)))


def _refused_notes(model: ModelFolder, refused: dict[str, str]) -> tuple[str, ...]:
    """What the table leaves out because load_pipeline refuses it with this pipeline, in its words; and what a
    ControlNet adds that the columns do not count."""
    notes, left_out = [], [w for w in ("pipefusion", "shard_weights") if w in refused]
    for why in dict.fromkeys(refused[w] for w in left_out):
        names = [REFUSABLE[w] for w in left_out if refused[w] == why]
        notes.append(
            f"no {' or '.join(names)} rows: {refusal_message(refused, [w for w in left_out if refused[w] == why])}"
        )
    if "controlnet" in model.weights:
        notes.append(
            f"the ControlNet's weights are whole on every rank; its {_controlnet_blocks(model)} blocks are counted "
            f"in the GB sent as blocks of the transformer's (the same width), but under PipeFusion, where every rank "
            f"runs the whole ControlNet and it moves nothing; the work column leaves it out"
        )
    return tuple(notes)


def _controlnet_blocks(model: ModelFolder) -> int:
    """The blocks of the pipeline's ControlNet (0 without one), as its family's ControlNet adapter counts them."""
    controlnet = model.weights.get("controlnet")
    if controlnet is None or controlnet.class_name not in CONTROLNETS:
        return 0
    return CONTROLNETS[controlnet.class_name].num_blocks(controlnet.config)


def _quantize_notes(quantize: str | None) -> tuple[str, ...]:
    if quantize is None:
        return ()
    return (
        f"{quantize} weight-only (torchao): the linear weights of the transformer and the text encoders, "
        f"one byte per element plus a scale per output row; the rest at the load dtype",
        "no sharded rows with quantized weights: torchao's quantized tensors have no FSDP2 all-gather "
        "(fsdp_pre_all_gather), so load_pipeline refuses the two together; plan without --quantize to see them",
    )


def plan_row(
    model: ModelFolder,
    config: ParallelConfig,
    *,
    shard: bool = False,
    placement: str | dict = "gpu",
    quantize: str | None = None,
    quantized: tuple[str, ...] | None = None,
    call: Call | None = None,
    shape: RequestShape | None = None,
    gpu_memory_bytes: int = 0,
    planned: PlannedRequest | None = None,
    offload: int | None = None,
) -> FitRow:
    """What one rank holds under `config` with the transformer's weights sharded (`shard`) or not, the text
    encoders placed (`placement`: "gpu", "sharded", "host", or a dict of them by text encoder) and the linear
    weights of `quantized` (default: every component a named scheme covers) in the scheme `quantize`: one row of
    plan_model's, and the one a load asks for (plan_memory). Its request terms are those of `call`, whose
    closed form is `shape`; without them (a family with no closed form yet) they are unknown, said so. With
    `offload` (N), the transformer's blocks are in host memory, N at a time on the GPU (weights.Offloaded)."""
    transformer, t = model.transformer, model.transformer.config
    covered = (tuple(model.quantizable) if quantized is None else quantized) if quantize else ()
    known = call is not None and shape is not None
    weights, gather, stale, encode_gather, host, offloaded = held_weights(
        model,
        config,
        shard,
        placement,
        (lambda span: stale_kv(model, call, shape, config, span)) if known else None,
        scheme=quantize,
        quantized=covered,
        offload=offload or None,
    )
    prompts, branches = (call.prompts, call.branches) if known else (1, 1)
    blocks = len(transformer.blocks)
    # a ControlNet's blocks run beside the transformer's each step, as wide: counted in the traffic as more blocks
    # (it runs neither sharded nor pipelined, so nothing else of the cost changes); under PipeFusion it runs whole
    # on every rank and moves nothing
    if config.pipefusion == 1:
        blocks += _controlnet_blocks(model)
    heads, head_dim = model.adapter.attention_shape(t)
    cost = config.cost(blocks, num_heads=heads, batch=prompts, use_cfg=branches == 2, shard_weights=shard)
    hidden = heads * head_dim
    unknown = []
    decode = None
    # the 2D decoder's (AutoencoderKL's, Flux.2's) and every video VAE's (measured: tests/test_vae.py)
    if known:
        decode = planned_decode_peak(model, call, shape, decode_bands(config))
        if decode is None:
            vae = model.configs.get("vae", {}).get("_class_name", "no VAE")
            formed = ", ".join((*PLANAR_VAES, *VIDEO_DECODE_PEAKS))
            why = UNPLANNED_DECODES.get(vae, f"only {formed} have one")
            unknown.append(f"decode peak: {vae} has no closed form here ({why}); measure it")
    else:
        unknown.append("latents, conditioning, stale K/V, decode peak: no closed form for this request here")
    if isinstance(placement, dict):  # a load's: each text encoder's own (one word where they agree)
        placement = next(iter(set(placement.values()))) if len(set(placement.values())) == 1 else "mixed"
    return FitRow(
        config=config,
        shard_weights=shard,
        text_encoders=placement,
        weights=weights,
        gather=gather,
        latents=prompts * shape.latents_per_prompt if known else 0,
        conditioning=prompts * branches * shape.conditioning_per_row + shape.shared if known else 0,
        stale_kv=stale,
        decode_peak=decode,
        gpu_memory_bytes=gpu_memory_bytes,
        cost=cost,
        activation_traffic=round(cost.comm_bytes(shape.image_tokens, hidden, model.element)) if known else 0,
        gather_traffic=round(cost.gather_weights * transformer.whole),
        encode_gather_traffic=encode_gather,
        host_bytes=host,
        quantize=quantize,
        offload_blocks=offload or None,
        # past PipeFusion's warmup a stage runs its blocks once per patch, each run bringing them over again
        offload_traffic=offloaded.moved_per_step(config.patches if config.pipefusion > 1 else 1) if offloaded else 0,
        unknown=tuple(unknown),
        bounds=shape.bounds if known else (),
        request=planned,
    )
