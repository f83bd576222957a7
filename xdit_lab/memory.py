"""The memory plan: bytes per component per rank, computed from safetensors headers before
anything is loaded, and checked against the memory each rank really has.

A safetensors file starts with an 8-byte little-endian header length and a JSON header giving
every tensor's dtype, shape and byte range, so sizes are known without reading weights, and a
truncated file is caught here (the header promises more bytes than the file holds) instead of
deep inside a loader.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ParallelConfig
from .families import FAMILIES, block_index
from .model_folder import EXPERT, TRANSFORMER, ModelFolder, component_role
from .safetensors_io import read_safetensors_header

DTYPE_BYTES = dict(F64=8, F32=4, F16=2, BF16=2, I64=8, I32=4, I16=2, I8=1, U8=1, BOOL=1, F8_E4M3=1, F8_E5M2=1)
FLOATS = {"F64", "F32", "F16", "BF16"}


class MemoryPlanError(MemoryError):
    """The plan does not fit the memory a rank has; the message holds the numbers."""


def tensor_bytes(info: dict, dtype: torch.dtype | None) -> int:
    count = 1
    for dim in info["shape"]:
        count *= dim
    element = DTYPE_BYTES.get(info["dtype"], 4)
    if dtype is not None and info["dtype"] in FLOATS:  # floats are cast to the requested dtype on load
        element = torch.empty(0, dtype=dtype).element_size()
    return count * element


@dataclass
class MemoryPlan:
    component_bytes: dict[str, int]  # whole component, as loaded
    per_rank_bytes: dict[str, int]  # what one rank holds
    ranks_per_host: int = 1
    notes: list[str] = field(default_factory=list)
    # activations on top of the weights, as (serial, per rank): "decode peak" (the VAE's), and for a
    # request (ParallelPipeline.memory_plan_for) "latents", "conditioning", "stale K/V" (PipeFusion's)
    activation_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)
    # the transformer as PipeFusion splits it: bytes every stage keeps, and each block's bytes
    transformer_blocks: tuple[int, list[int]] | None = None

    @property
    def total_per_rank(self) -> int:
        return sum(self.per_rank_bytes.values()) + sum(per_rank for _, per_rank in self.activation_bytes.values())

    def table(self) -> str:
        lines = [f"  {'component':<16} {'whole':>12} {'per rank':>12}"]
        for name, whole in self.component_bytes.items():
            lines.append(f"  {name:<16} {human_bytes(whole):>12} {human_bytes(self.per_rank_bytes[name]):>12}")
        for name, (serial, per_rank) in self.activation_bytes.items():
            lines.append(f"  {name:<16} {human_bytes(serial):>12} {human_bytes(per_rank):>12}")
        whole = sum(self.component_bytes.values()) + sum(serial for serial, _ in self.activation_bytes.values())
        lines.append(f"  {'total':<16} {human_bytes(whole):>12} {human_bytes(self.total_per_rank):>12}")
        return "\n".join(lines + [f"  ({note})" for note in self.notes])


def component_tensor_bytes(folder: Path, dtype: torch.dtype | None, header=read_safetensors_header) -> dict[str, int]:
    """Bytes of every tensor in a component folder's safetensors, as loaded in `dtype`, from the headers alone
    (`header`: a file's table; ModelFolder.header parses each file once per load)."""
    return {
        key: tensor_bytes(info, dtype)
        for f in sorted(Path(folder).glob("*.safetensors"))
        for key, info in header(f).items()
    }


def block_bytes(tensors: dict[str, int], transformer_config: dict) -> tuple[dict[int, int], int]:
    """A transformer's tensor bytes split into {stacked block index: bytes} and the bytes outside the
    blocks (its config names the family, whose adapter names the block lists)."""
    blocks: dict[int, int] = {}
    shared = 0
    for key, size in tensors.items():
        index = block_index(transformer_config, key)
        if index is not None:
            blocks[index] = blocks.get(index, 0) + size
        else:
            shared += size
    return blocks, shared


def plan_memory(
    folder: Path | ModelFolder,
    components: list[str],
    *,
    dtype: torch.dtype | None,
    config: ParallelConfig | None = None,
    ranks_per_host: int = 1,
    decode_latent: tuple[int, int] | None = None,
    stale_kv_rows: int | None = None,
) -> MemoryPlan:
    """Bytes of every component's safetensors, and what one rank holds of them under `config` (default:
    one rank): under PipeFusion a stage holds its transformer blocks, and Wan 2.2 A14B's second expert's (the largest
    stage's share is planned) plus every tensor outside the blocks (embeddings, output layers); every other component
    is whole on every rank.

    With `decode_latent` (latent rows, cols), the plan adds the VAE decode's activation peak for
    one image of that latent: whole, and per rank in the row bands the config decodes it in (vae.py).
    With `stale_kv_rows` (batch rows per rank) and pipefusion > 1, it adds the largest stage's stale
    K/V buffers for those rows at that latent (models/pipefusion/). `folder`: a path, or the load's ModelFolder
    (its headers parsed once, its roles naming the transformer and the expert)."""
    config = ParallelConfig() if config is None else config
    model = folder if isinstance(folder, ModelFolder) else None
    folder, header = (model.path, model.header) if model is not None else (Path(folder), read_safetensors_header)
    index = model.index if model is not None else {}
    whole, per_rank, transformer_blocks = {}, {}, None
    for name in components:
        tensors = component_tensor_bytes(folder / name, dtype, header)
        whole[name] = per_rank[name] = sum(tensors.values())
        role = component_role(name, (index.get(name) or [None])[0])
        if role in (TRANSFORMER, EXPERT):  # transformer_2: Wan 2.2 A14B's second expert, cut into the same stages
            transformer_config = json.loads((folder / name / "config.json").read_text())
            blocks, shared = block_bytes(tensors, transformer_config)
            if blocks and name == "transformer":
                transformer_blocks = (shared, [blocks.get(i, 0) for i in range(max(blocks) + 1)])
            if config.pipefusion > 1:
                per_rank[name] = _largest_stage_bytes(blocks, shared, config)
    plan = MemoryPlan(whole, per_rank, ranks_per_host)
    plan.transformer_blocks = transformer_blocks
    if (
        stale_kv_rows is not None
        and decode_latent is not None
        and config.pipefusion > 1
        and "transformer" in components
    ):
        kv = _stale_kv_bytes(folder, config, stale_kv_rows, decode_latent, dtype, header)
        if kv:
            plan.activation_bytes["stale K/V"] = (0, kv)  # a single rank keeps no stale K/V
            plan.notes.append(
                f"stale K/V: PipeFusion's buffers for one prompt at the default size, {stale_kv_rows} row(s)"
            )
    config_path = Path(folder) / "vae" / "config.json"
    if decode_latent is not None and "vae" in components and config_path.is_file():
        vae_config = json.loads(config_path.read_text())
        if vae_config.get("_class_name") == "AutoencoderKL":
            element = _float_bytes(folder / "vae", dtype, header)
            shape = (1, vae_config["latent_channels"], *decode_latent)
            plan.activation_bytes["decode peak"] = (
                decode_peak_bytes(vae_config, shape, element),
                decode_peak_bytes(vae_config, shape, element, bands=decode_bands(config)),
            )
            plan.notes.append(f"decode peak: one image of a {decode_latent[0]}×{decode_latent[1]} latent")
    return plan


def decode_bands(config: ParallelConfig) -> int:
    """Row bands the VAE decodes one image in: over the ranks that share it (vae.py), or whole."""
    return config.sp_degree * config.pipefusion if config.vae_parallel else 1


def _stale_kv_bytes(
    folder: Path, config: ParallelConfig, rows: int, latent: tuple[int, int], dtype, header=read_safetensors_header
) -> int | None:
    """The largest stage's stale K/V buffers, from the transformer's config and header: its
    self-attention layers (the family adapter's names), heads, patches and this rank's rows."""
    from .families.adapter import SEQUENCE_PARALLEL_KINDS as STALE_KINDS  # a PipeFusion stage keeps their K/V

    model = json.loads((folder / "transformer" / "config.json").read_text())
    adapter = FAMILIES.get(model.get("_class_name"))
    if adapter is None:
        return None
    per_block = collections.Counter(  # attention modules with stale K/V (named by their K projection) per block
        adapter.block_index(key, model)
        for key in component_tensor_bytes(folder / "transformer", dtype, header)
        if key.endswith(".to_k.weight")
        and adapter.block_index(key, model) is not None
        and adapter.attention_kind(key.removesuffix(".to_k.weight")) in STALE_KINDS
    )
    grid = adapter.latents.planned_grid(latent, model)  # None for a video: its frames come with the call
    grid = grid and adapter.latents.patch_grid(grid)
    if grid is None or grid[0] < config.patches:
        return None  # not known before the call, or too small to cut: the call is planned (or refused) then
    element = _float_bytes(folder / "transformer", dtype, header)
    return max(
        busiest_stale_kv_bytes(config, model, sum(per_block[i] for i in range(start, stop)), rows, grid, element)
        for start, stop in config.stage_ranges(adapter.num_blocks(model))
    )


def busiest_stale_kv_bytes(
    config: ParallelConfig, transformer: dict, layers: int, rows: int, grid, element: int
) -> int:
    """The stale K/V buffers of a PipeFusion stage's busiest rank under `config` (the ring rank that keeps
    the most: stale_kv_bytes), for `layers` attention layers whose K/V it keeps, `rows` batch rows, a
    `grid` (rows, cols) of tokens and the heads of the transformer's config.json (`transformer`), with
    `element` bytes per float: what the memory plan and the planner (fit/) count."""
    from .attention.stale import stale_kv_bytes

    return max(
        stale_kv_bytes(
            layers=layers,
            rows=rows,
            heads=transformer["num_attention_heads"],
            head_dim=transformer["attention_head_dim"],
            grid=grid,
            patches=config.patches,
            ulysses=config.ulysses,
            ring=config.ring,
            ring_rank=ring_rank,
            element_bytes=element,
        )
        for ring_rank in range(config.ring)
    )


def _float_bytes(folder: Path, dtype: torch.dtype | None, header=read_safetensors_header) -> int:
    """Bytes per element of a component's activations: the load dtype, else its weights' float dtype."""
    if dtype is not None:
        return torch.empty((), dtype=dtype).element_size()
    for f in sorted(folder.glob("*.safetensors")):
        for info in header(f).values():
            if info["dtype"] in FLOATS:
                return DTYPE_BYTES[info["dtype"]]
    return 4


def decode_peak_bytes(vae_config: dict, latent_shape, element_bytes: int, *, bands: int = 1) -> int:
    """The most bytes an AutoencoderKL decode holds at once (weights and the latent not counted),
    from its configuration: the largest set of activations alive together, in units of channels
    × pixels at each resolution (diffusers' decoder, step by step):

        resnet c_in -> c_out     input (held by the caller) + shortcut, hidden, sum, sum / scale
        ×2 upsample of c         input + interpolated (4×) + convolved (4×)
        mid attention            input, norm, q, k, v, out, projection (flash kernels: no scores);
                                 in bands Ring's two K/V buffers and the merged partial outputs

    In bands (vae.py) a rank holds its band's rows (the largest band) and every 3×3 convolution
    also a copy of its input with the halo rows. Against lab.measure.PeakTensorBytes on CPU
    (tests/test_vae.py): exact for the whole decode, within 5% in bands."""
    batch, latent_channels, rows, cols = latent_shape
    rows = -(-rows // bands)
    blocks = list(reversed(vae_config["block_out_channels"]))

    def pixels(scale):  # (a band's pixels, its convolutions' input with halo rows) at this scale
        band = rows * scale * cols * scale
        return band, (band + 2 * cols * scale if bands > 1 else 0)

    top = blocks[0]
    p, halo = pixels(1)
    # the post-quant latent, held while the decoder runs
    held = latent_channels * p if vae_config.get("use_post_quant_conv", True) else 0
    peaks = [latent_channels * (p + halo) + top * p, 4 * top * p]
    if vae_config.get("mid_block_add_attention", True):
        attention = 7 if bands == 1 else 16  # Ring adds two K/V buffers (2 each), partial outputs and their merge
        peaks.append(attention * top * p)
    previous, scale = top, 1
    for i, out in enumerate(blocks):
        p, halo = pixels(scale)
        block_input = previous * p  # held by the decoder's loop until the up block returns
        for j in range(vae_config["layers_per_block"] + 1):
            c_in, also_held = (previous, 0) if j == 0 else (out, block_input)
            end = (c_in + 4 * out if c_in != out else 4 * out) * p  # shortcut, hidden, sum, sum / scale
            first_conv = 2 * c_in * p + c_in * halo + out * p  # input, activation, its halo copy, output
            peaks += [also_held + end, also_held + first_conv]
        if i < len(blocks) - 1:
            scale *= 2
            high, high_halo = pixels(scale)
            peaks.append(block_input + out * (p + 2 * high + high_halo))
        previous = out
    first = vae_config["block_out_channels"][0]
    p, halo = pixels(scale)
    peaks.append(3 * first * p + first * halo + 3 * p)  # norm, activation, conv_out to RGB
    return batch * (held + max(peaks)) * element_bytes


def _largest_stage_bytes(blocks: dict[int, int], shared: int, config: ParallelConfig) -> int:
    try:
        ranges = config.stage_ranges(len(blocks))
    except ValueError:  # not a split PipeFusion can make; load_pipeline refuses it later
        return shared + sum(blocks.values())
    return shared + max(sum(blocks.get(i, 0) for i in range(start, stop)) for start, stop in ranges)


def available_bytes(device: torch.device) -> int:
    """Free memory for one rank: free GPU memory, or the host's available RAM shared by its ranks.

    On CUDA the device's free memory does not count what torch's caching allocator holds for this
    process without using it (blocks of a model freed before a reload): those are free to us too."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_plan(plan: MemoryPlan, device: torch.device, *, limit_bytes: int | None = None, config=None) -> None:
    """Fail before loading when one rank's share does not fit, with the numbers and what to change."""
    if limit_bytes is None:
        limit_bytes = available_bytes(device)
        if device.type == "cpu":
            limit_bytes //= max(1, plan.ranks_per_host)  # CPU ranks on one host share its RAM
    if plan.total_per_rank <= limit_bytes:
        return
    advice = ["load in bfloat16 (torch_dtype=torch.bfloat16) to halve float32 weights"]
    if plan.transformer_blocks is not None:
        advice.append(_pipefusion_advice(plan, limit_bytes, config.pipefusion if config is not None else 1))
    if "decode peak" in plan.activation_bytes:
        serial, per_rank = plan.activation_bytes["decode peak"]
        if per_rank == serial:
            advice.append(
                f"the VAE decode's peak ({human_bytes(serial)}) splits in row bands over the ranks that share an image "
                f"(ulysses, ring or pipefusion above 1, with vae_parallel=True, the default)"
            )
    if device.type == "cpu" and plan.ranks_per_host > 1:
        advice.append(f"run fewer ranks per host ({plan.ranks_per_host} share this host's memory now)")
    where = f"{device}" + (f" under {config.short()}" if config is not None else "")
    raise MemoryPlanError(
        f"the pipeline needs {human_bytes(plan.total_per_rank)} per rank on {where}, but only {human_bytes(limit_bytes)} is "
        f"available per rank:\n{plan.table()}\nTo fit: " + "; or ".join(advice) + "."
    )


def _pipefusion_advice(plan: MemoryPlan, limit_bytes: int, current: int) -> str:
    """The smallest PipeFusion degree above `current` whose largest stage fits, counting what every
    stage keeps (embeddings, output layers) besides its blocks; or what the most stages would hold."""
    shared, blocks = plan.transformer_blocks
    others = plan.total_per_rank - plan.per_rank_bytes["transformer"]

    def stage_bytes(stages):
        return shared + max(
            sum(blocks[start:stop]) for start, stop in ParallelConfig(pipefusion=stages).stage_ranges(len(blocks))
        )

    degrees = range(max(2, current + 1), len(blocks) + 1)
    fitting = [n for n in degrees if others + stage_bytes(n) <= limit_bytes]
    kept = f"{human_bytes(shared)} outside the blocks on every stage"
    if fitting:
        n = fitting[0]
        return (
            f"PipeFusion splits the transformer's {len(blocks)} blocks over stages: pipefusion {n} holds "
            f"{human_bytes(stage_bytes(n))} of it per rank ({kept})"
        )
    if not degrees:
        return f"PipeFusion cannot split the transformer's {len(blocks)} blocks further than pipefusion {current}"
    most = len(blocks)
    return (
        f"PipeFusion alone does not fit it: even pipefusion {most} (one block per stage) holds "
        f"{human_bytes(stage_bytes(most))} of the transformer per rank ({kept})"
    )


def human_bytes(n: float) -> str:
    """'1.5 MB': decimal units (10³, 10⁶, 10⁹ bytes), as GPU vendors sell memory and the planner counts it."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
