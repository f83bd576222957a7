"""The rows of a plan: every configuration × sharded or whole weights × where the text encoders
live, what one rank holds under each (FitRow), ranked; and the table the command prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import DEGREES, CostEstimate, ParallelConfig
from ..families import CONTROLNETS, recipe_for
from ..families.refusals import REFUSABLE, load_refusals, refusal_message
from ..memory import busiest_stale_kv_bytes, decode_peak_bytes
from ..model_folder import ModelFolder, read_model_folder
from ..plan_table import aligned, legend
from ..quantization import SCHEMES, TRANSFORMERS
from ..sharding import batch_rows
from .requests import Call, RequestShape, make_call, request_shape

# Link bandwidths the planner turns traffic into seconds with (one direction, per GPU, peak; NCCL
# reaches some 80% of them):
NVLINK_BYTES_PER_S = 450e9  # NVLink 4 (H100 SXM): 900 GB/s per GPU both ways, NVIDIA's H100 datasheet
PCIE_BYTES_PER_S = 32e9  # PCIe 4.0 x16: 16 GT/s × 16 lanes × 128/130 ≈ 31.5 GB/s (PCI-SIG), 24 GB cards' link
LINKS = {"NVLink": NVLINK_BYTES_PER_S, "PCIe": PCIE_BYTES_PER_S}

PLACEMENTS = ("gpu", "sharded", "host")  # where text encoders live; ranked in this order at equal cost
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

    def describe(self) -> str:
        frames = f", {self.frames} latent frames" if self.frames > 1 else ""
        quantized = f", its linear weights {self.quantize}" if self.quantize else ""
        return (
            f"{self.pipeline_class} ({self.transformer_class}, {self.transformer_bytes / GB:.1f} GB in {self.dtype}"
            f"{quantized}) "
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
    host_bytes: int  # text encoders kept in host memory by this rank's process
    quantize: str | None = None  # the transformer's and text encoders' linear weights in this scheme
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
        )

    def to_json(self) -> dict:
        return dict(
            config=self.config.short(),
            degrees={d: getattr(self.config, d) for d in DEGREES},
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
    quantized tensors have no FSDP2 all-gather: load_pipeline refuses the two together)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive whole number, got {world_size!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive whole number of prompts, got {batch!r}")
    if not isinstance(gpu_memory_bytes, int) or gpu_memory_bytes < 1:
        raise ValueError(f"gpu_memory_bytes must be a positive whole number of bytes, got {gpu_memory_bytes!r}")
    if quantize is not None and quantize not in SCHEMES:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)} (weight-only, torchao), got {quantize!r}")
    model = read_model_folder(folder, dtype)
    call = make_call(model, height=height, width=width, batch=batch, use_cfg=use_cfg, options=options)
    shape = request_shape(model, call)
    t = model.transformer.config
    blocks = model.adapter.num_blocks(t)
    configs = ParallelConfig.options(
        world_size,
        num_heads=t["num_attention_heads"],
        num_layers=blocks,
        seq_len=shape.image_tokens,
        use_cfg=call.branches == 2,
        batch=batch,
    )
    configs = [c for c in configs if c.pipefusion == 1 or shape.grid[0] >= c.patches]
    # what load_pipeline refuses with this pipeline (two experts, a ControlNet, Kontext's references) is not planned
    refused = load_refusals(recipe_for(model.pipeline_class), model.pipeline_class, model.weights)
    if quantize and "quantization" in refused:
        raise ValueError(refusal_message(refused, ["quantization"]))
    if "pipefusion" in refused:
        configs = [c for c in configs if c.pipefusion == 1]
    unsharded = "shard_weights" in refused  # neither the transformer's weights nor the text encoders' sharded
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
        (*model.notes, *shape.bounds, *_quantize_notes(quantize), *_refused_notes(model, refused)),
        quantize,
        tuple(model.text_encoders),
    )
    rows = []
    for config in configs:
        for shard in (False, True):
            if shard and (quantize or unsharded):
                continue  # refused by load_pipeline: see _quantize_notes, _refused_notes
            if shard and world_size // config.pipefusion == 1:
                continue  # nothing to shard: every rank of a stage is alone with its blocks
            for placement in PLACEMENTS:
                if placement == "sharded" and (world_size == 1 or not model.text_encoders or quantize or unsharded):
                    continue
                if placement != "gpu" and not model.text_encoders:
                    continue
                rows.append(_row(model, call, shape, config, shard, placement, gpu_memory_bytes, planned, quantize))
    return sorted(rows, key=fit_rank_key)


def fit_rank_key(row: FitRow) -> tuple:
    """Fitting rows first; then least work, least traffic per step (FSDP2's gathers included), text
    encoders on the GPU before sharded before host (the encode's speed), least memory, simplest."""
    config = row.config
    return (
        not row.fits,
        round(row.cost.work_fraction, 9),
        row.traffic_per_step,
        PLACEMENTS.index(row.text_encoders),
        row.per_rank_bytes,
        sum(getattr(config, d) > 1 for d in DEGREES),
        config.dp,
        -config.cfg,
        -config.ulysses,
        -config.ring,
    )


def held_weights(
    model: ModelFolder, config, shard: bool, placement, stale=None, scheme: str | None = None, quantized=()
) -> tuple[dict, int, int, int, int]:
    """What one rank holds of each component's weights under `config`: ({component: bytes on this rank's
    device}, the gather buffer, the busiest stage's stale K/V (from `stale(span)`, if given), bytes all-gathered
    per request for sharded text encoders, bytes of text encoders kept in host memory). The transformer
    sharded over the ranks of a stage (world / pipefusion) when `shard`; text encoders whole ("gpu"),
    sharded over the world ("sharded") or in host memory ("host"): one placement for all, or a dict of
    them by component (missing ones: "gpu"); the rest whole on every rank. With `scheme`, the components in
    `quantized` hold their linear weights quantized (quantization.py; never with `shard`)."""
    world = config.world_size
    transformer = model.transformer
    shards = world // config.pipefusion if shard else 1
    # Wan 2.2 A14B's second expert is held as the first: the same stage of its blocks, sharded or quantized alike
    experts = [(name, model.weights[name]) for name in TRANSFORMERS if name in model.weights]
    per_stage = []  # ({expert: weights}, gather, stale K/V) of each stage: the busiest is planned
    for span in config.stage_ranges(len(transformer.blocks)):
        kept = stale(span) if stale is not None and config.pipefusion > 1 else 0  # one expert's: the other freed
        held = {name: w.held(shards, span, scheme if name in quantized else None) for name, w in experts}
        gather = max(w.gather(shards, span) for _, w in experts)  # one expert runs at a time: one gather buffer
        per_stage.append((held, gather, kept))
    held, gather, kept = max(per_stage, key=lambda stage: sum(stage[0].values()) + stage[1] + stage[2])
    weights = dict(held)
    encode_gather, host, encoder_gathers = 0, 0, [0]
    for name in model.text_encoders:
        encoder = model.weights[name]
        where = placement.get(name, "gpu") if isinstance(placement, dict) else placement
        held = encoder.held(1, scheme=scheme if name in quantized else None)  # whole, or quantized
        if where == "gpu":
            weights[name] = held
        elif where == "sharded":
            weights[name] = encoder.held(world)
            encoder_gathers.append(encoder.gather(world))
            encode_gather += encoder.whole * (world - 1) // world
        else:
            weights[name] = 0
            host += held
    for name, component in model.weights.items():
        weights.setdefault(name, component.whole)  # the VAE and anything else: whole on every rank
    return weights, max(gather, *encoder_gathers), kept, encode_gather, host


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


def _row(
    model: ModelFolder, call: Call, shape: RequestShape, config, shard, placement, gpu_memory, planned, quantize=None
) -> FitRow:
    transformer, t = model.transformer, model.transformer.config
    experts = [name for name in TRANSFORMERS if name in model.weights]
    covered = (*experts, *model.text_encoders) if quantize else ()
    weights, gather, stale, encode_gather, host = held_weights(
        model,
        config,
        shard,
        placement,
        lambda span: _stale_kv(model, call, shape, config, span),
        scheme=quantize,
        quantized=covered,
    )
    blocks = len(transformer.blocks)
    # a ControlNet's blocks run beside the transformer's each step, as wide: counted in the traffic as more blocks
    # (it runs neither sharded nor pipelined, so nothing else of the cost changes); under PipeFusion it runs whole
    # on every rank and moves nothing
    if config.pipefusion == 1:
        blocks += _controlnet_blocks(model)
    cost = config.cost(blocks, batch=call.prompts, use_cfg=call.branches == 2, shard_weights=shard)
    hidden = t["num_attention_heads"] * t["attention_head_dim"]
    unknown = []
    decode = None
    if shape.decode_latent is not None and model.configs["vae"].get("_class_name") == "AutoencoderKL":
        bands = config.sp_degree * config.pipefusion if config.vae_parallel else 1
        decode = decode_peak_bytes(model.configs["vae"], (1, *shape.decode_latent), model.element, bands=bands)
    else:
        vae = model.configs.get("vae", {}).get("_class_name", "no VAE")
        unknown.append(f"decode peak: {vae} has no closed form here (AutoencoderKL's only); measure it")
    return FitRow(
        config=config,
        shard_weights=shard,
        text_encoders=placement,
        weights=weights,
        gather=gather,
        latents=call.prompts * shape.latents_per_prompt,
        conditioning=call.prompts * call.branches * shape.conditioning_per_row + shape.shared,
        stale_kv=stale,
        decode_peak=decode,
        gpu_memory_bytes=gpu_memory,
        cost=cost,
        activation_traffic=round(cost.comm_bytes(shape.image_tokens, hidden, model.element)),
        gather_traffic=round(cost.gather_weights * transformer.whole),
        encode_gather_traffic=encode_gather,
        host_bytes=host,
        quantize=quantize,
        unknown=tuple(unknown),
        bounds=shape.bounds,
        request=planned,
    )


def _stale_kv(model: ModelFolder, call: Call, shape: RequestShape, config, span) -> int:
    """PipeFusion's stale K/V on a stage holding blocks [start, stop): its self/joint attention layers,
    the busiest rank's batch rows, this rank's tokens (attention/stale.py's stale_kv_bytes)."""
    total = call.prompts * call.branches
    rows = max(
        stop - start
        for c in range(config.cfg)
        for d in range(config.dp)
        for start, stop, _ in [batch_rows(total, config.cfg, config.dp, c, d)]
    )
    layers = sum(stale_layers(model)[span[0] : span[1]])
    return busiest_stale_kv_bytes(config, model.transformer.config, layers, rows, shape.grid, model.element)


def stale_layers(model: ModelFolder) -> list[int]:
    """Per transformer block, its attention layers whose image K/V a PipeFusion stage keeps (self and
    joint, not cross: the family adapter's kinds), named in the header by their K projections."""
    if model.stale_layers is None:
        from ..models.pipefusion import STALE_KINDS

        t, adapter = model.transformer.config, model.adapter
        counts = [0] * len(model.transformer.blocks)
        for key in model.transformer.names:
            index = adapter.block_index(key, t)
            if key.endswith(".to_k.weight") and index is not None:
                counts[index] += adapter.attention_kind(key.removesuffix(".to_k.weight")) in STALE_KINDS
        model.stale_layers = counts
    return model.stale_layers


# ---- reading a plan -----------------------------------------------------------------------------------------


def smallest_fit(rows: list[FitRow]) -> FitRow:
    """The row that needs the least GPU memory: what to buy when nothing fits."""
    return min(rows, key=lambda row: (row.per_rank_bytes, fit_rank_key(row)))


def gigabytes(n: float | None) -> str:
    return "?" if n is None else f"{n / GB:.2f}"


def format_rows(rows: list[FitRow], top: int = 10, wide: bool = False) -> str:
    """The ranked rows as an aligned table, GB (10⁹ bytes) per rank: what decides a row (its placement,
    its total, whether it fits, its work and traffic), within 100 columns; `wide` adds every term of the
    total, a column each (each component's weights, the gather buffer, latents and conditioning, stale
    K/V, the decode's peak). model_legend says what each column means."""
    shown = rows[: top or None]
    table = [table_header(shown, wide)]
    for i, row in enumerate(shown, start=1):
        terms = [
            *(gigabytes(row.weights[name]) for name in row.weights),
            gigabytes(row.gather),
            gigabytes(row.latents + row.conditioning),
            gigabytes(row.stale_kv),
            gigabytes(row.decode_peak),
        ]
        table.append(
            [
                str(i),
                row.config.short(),
                "sharded" if row.shard_weights else "whole",
                row.text_encoders,
                gigabytes(row.per_rank_bytes),
                "yes" if row.fits else "no",
                *(terms if wide else []),
                f"{row.cost.work_fraction:.3g}",
                gigabytes(row.traffic_per_step),
                *(f"{row.seconds_per_step(bandwidth):.3f}" for bandwidth in LINKS.values()),
            ]
        )
    return aligned(table, left={1, 2, 3})  # config, weights, text encoders


TERM_COLUMNS = ("gather", "latents+cond", "stale K/V", "decode")  # with --wide, after each component's weights
LINK_COLUMNS = {name: f"{name} s" for name in LINKS}  # a link's seconds per step, a column each


def table_header(rows: list[FitRow], wide: bool = False) -> list[str]:
    """format_rows' column names: the terms of GB/rank (each component's weights, then TERM_COLUMNS) only
    when `wide`."""
    terms = [*(rows[0].weights if rows else ()), *TERM_COLUMNS] if wide else []
    return ["#", "config", "weights", "text enc", "GB/rank", "fits", *terms, "work", "GB sent", *LINK_COLUMNS.values()]


def model_legend(rows: list[FitRow], wide: bool = False) -> str:
    """What each column of format_rows(rows, wide=wide) means, a line or a few each, within 100 columns."""
    memory = f"{rows[0].gpu_memory_bytes / GB:.3g} GB" if rows else "one GPU's memory"
    meanings = {
        "#": "the rank, best first: fitting rows, then least work, least GB sent, text encoders gpu before "
        "sharded before host, least GB/rank; --why says which decided each row",
        "config": "the degrees above 1, joined by · (cfg2·pf2: cfg 2 × pf 2): dp data parallel, cfg guidance's "
        "two branches side by side, pf PipeFusion stages, ring and ulysses sequence parallel",
        "weights": "the transformer's weights: whole on every rank (of its PipeFusion stage), or sharded by "
        "FSDP2 over the ranks that hold the same blocks, each block gathered whole as it runs",
        "text enc": "the text encoders: gpu = whole on every GPU; sharded = FSDP2 over all ranks, gathered "
        "once per request; host = in host memory and run there (a slower encode; not in GB/rank)",
        "GB/rank": "what one rank's GPU holds: weights, FSDP2's gather buffer, latents, conditioning, "
        "PipeFusion's stale K/V and the decode's peak, summed" + ("" if wide else " (--wide shows each)"),
        "fits": f"yes if GB/rank is at most one GPU's memory ({memory})",
        "gather": "FSDP2's gathered copies while a sharded unit runs (the largest block's and the "
        "transformer's root; a sharded text encoder's); 0 with nothing sharded",
        "latents+cond": "the latents and the prompts' conditioning a rank keeps between steps",
        "stale K/V": "PipeFusion's stale keys and values of the busiest stage's attention layers",
        "decode": "the VAE decode's peak (split in row bands over a group's ranks); ? when the configs "
        "cannot tell (a note says why)",
        "work": "single-image transformer forwards per rank per step (lower is faster)",
        "GB sent": "what one rank sends per denoising step: the strategy's activations, plus FSDP2's "
        "weight gathers when sharded",
        **{
            column: f"seconds per step to send GB sent at {name}'s {LINKS[name] / GB:.0f} GB/s (one direction, "
            "peak: xdit_lab.fit.LINKS)"
            for name, column in LINK_COLUMNS.items()
        },
    }
    for name in rows[0].weights if rows and wide else ():  # each component's weights on the rank's GPU
        meanings[name] = (
            "its weights on this rank's GPU: all, its PipeFusion stage's blocks, or an FSDP2 shard"
            if name in TRANSFORMERS
            else "its weights on this rank's GPU: all, an FSDP2 shard, or none (0.00) in host memory"
            if rows[0].request is not None and name in rows[0].request.text_encoders
            else "its weights, whole on every rank's GPU"
        )
    columns = table_header(rows, wide)
    return "Columns (GB = 10^9 bytes, per rank):\n" + legend([(name, meanings[name]) for name in columns])


WHERE = {"gpu": "whole on the GPU", "sharded": "sharded", "host": "in host memory"}  # text encoders, in words


def fit_ranking_reasons(rows: list[FitRow]) -> list[str]:
    """Why each row of a plan (plan_model's order) sits above the next, as config.ranking_reasons says it
    for `xdit-lab plan`: the first figure of fit_rank_key in which the two differ, named, with both values
    where it is one ('' for the last). A row is named by its rank in the list (#2)."""
    reasons = []
    for i, (row, below) in enumerate(zip(rows, rows[1:])):
        key, other = fit_rank_key(row), fit_rank_key(below)
        first = next((j for j, (a, b) in enumerate(zip(key, other)) if a != b), len(key))
        reasons.append(_reason(first, row, below, f"#{i + 2}"))
    return reasons + [""] * bool(rows)


def _reason(first: int, row: FitRow, below: FitRow, name: str) -> str:
    """The words for fit_rank_key's figure `first`, the first in which `row` and the next row (`below`,
    called `name`) differ."""
    if first == 0:
        return f"fits, {name} does not ({_pair(row.per_rank_bytes, below.per_rank_bytes)} GB per rank)"
    if first == 1:
        return f"less work per rank than {name} ({row.cost.work_fraction:.3g} vs {below.cost.work_fraction:.3g})"
    if first == 2:
        sent = _pair(row.traffic_per_step, below.traffic_per_step)
        return f"as much work, less sent per step than {name} ({sent} GB)"
    if first == 3:
        return (
            f"the same work and traffic as {name}; text encoders {WHERE[row.text_encoders]} encode sooner than "
            f"{WHERE[below.text_encoders]}"
        )
    if first == 4:
        return f"the same cost as {name}, less memory per rank ({_pair(row.per_rank_bytes, below.per_rank_bytes)} GB)"
    ties = (
        "the same cost and memory as {}, fewer degrees above 1 (simpler to run)",
        "ties with {}: less dp (preferred last)",
        "ties with {}: more cfg",
        "ties with {}: more Ulysses (its all-to-alls stay on the fast links)",
        "ties with {}: more Ring",
    )
    return (*ties, "the same as {}")[min(first - 5, len(ties))].format(name)


def _pair(a: int, b: int) -> str:
    """Two byte counts in GB, 'a vs b', with the fewest decimals (at least two) that tell them apart."""
    for digits in range(2, 10):
        left, right = f"{a / GB:.{digits}f}", f"{b / GB:.{digits}f}"
        if left != right:
            break
    return f"{left} vs {right}"
