"""The one planner: what each rank holds of a model, asked before a byte of weights is read, for the load
(`pipe.memory_plan`) and for `xdit-lab plan --model` alike.

    weights.py   the weight planner: whole, a PipeFusion stage, an FSDP2 shard, host-placed, quantized
    terms.py     the request terms: the call, latents, conditioning, stale K/V, decode peak
    rows.py      a row (plan_row: one configuration and placement) and every row, ranked (plan_model)
    load.py      a load's plan: the row for its configuration and placement, as a MemoryPlan (plan_memory)
    check.py     MemoryPlan checked against the memory a rank has (check_plan), human_bytes
    loaded.py    on a loaded pipeline: what a request adds (plan_request), what a rank holds now (rank_memory)
    table.py     the rows as the command prints them; command.py: `xdit-lab plan --model`

`plan_model(folder, world_size, gpu_memory_bytes)` reads a diffusers folder's model_index.json, each
component's config.json and the headers of its safetensors files (model_folder.ModelFolder), nothing
else, and returns one FitRow per way to run it on `world_size` GPUs:

    every valid ParallelConfig (ParallelConfig.options with the model's heads, blocks and tokens)
      × shard_weights in (False, True)        FSDP2: each parameter cut on dim 0 over the ranks that
                                               hold the same blocks, gathered just before a block runs
      × text encoders "gpu" | "sharded" | "host"   whole on every GPU, FSDP2 over the world, or kept in
                                               host memory and run there (offload: no GPU bytes)

A row says what one rank holds, by term, and whether the sum fits:

    weights       per component: whole; a PipeFusion stage's blocks and everything outside the blocks;
                  or, sharded, torch.chunk's largest piece of every parameter (buffers stay whole)
    gather        with sharded weights, the unsharded copies alive at once: three of the largest block
                  (the running one, its all-gather buffer, the next one's) plus the root (outside the
                  blocks), unsharded through a forward (Weights.gather); for sharded text encoders the
                  same during the encode. The encode's and the denoise's gathers are never alive
                  together: the larger of the two
    latents       every prompt's latents, whole on every rank
    conditioning  every row's text conditioning (both branches under CFG), whole on every rank
    stale K/V     PipeFusion's buffers on the busiest stage (attention/stale.py)
    decode peak   the VAE decode's activations in row bands (terms.planned_decode_peak: AutoencoderKL's 2D
                  decoder; the video VAEs' in video_decode.py (Wan's), cogvideox_decode.py, hunyuan_decode.py)

    e.g. FLUX.1-dev, ulysses 4, shard_weights, text encoders sharded, 4 GPUs:
        rank r:  transformer ¼ of each parameter (5.95 GB) | T5 + CLIP ¼ (2.4 GB) | VAE whole (0.17 GB)
                 + during a block: 3 × the largest block whole (3 × 680 MB) + the root whole (128 MB)

Latents and conditioning come from each family recipe's closed form (Recipe.planned_request), checked against
what the family's own encode and prepare hold on tiny pipelines (tests/test_fit.py). Where a term has no
closed form here (Sana's AutoencoderDC's decode peak) or cannot be known from the configs (Qwen-Image's
text length, which depends on the prompt), the row says so (`unknown`, `bounds`) instead of guessing. Transient
activations of a forward (attention, MLP intermediates) are not planned: they are measured.

Rows are ranked: fitting rows first, then by the cost model (ParallelConfig.cost), whose traffic now
includes FSDP2's gathers, turned into bytes per step and into seconds on NVLink and on PCIe.
"""

from .check import MemoryPlan, MemoryPlanError, available_bytes, check_plan, human_bytes
from .cogvideox_decode import cogvideox_decode_peak_bytes
from .hunyuan_decode import hunyuan15_decode_peak_bytes, hunyuan_decode_peak_bytes
from .load import plan_memory
from .rows import (
    GB,
    LINKS,
    NVLINK_BYTES_PER_S,
    PCIE_BYTES_PER_S,
    PLACEMENTS,
    FitRow,
    PlannedRequest,
    fit_rank_key,
    plan_model,
    plan_row,
    smallest_fit,
)
from .table import fit_ranking_reasons, format_rows, model_legend
from .terms import Call, RequestShape, decode_peak_bytes, make_call, request_shape
from .video_decode import wan_decode_peak_bytes
from .weights import block_bytes, component_tensor_bytes, held_weights, tensor_bytes

__all__ = [
    "GB",
    "LINKS",
    "NVLINK_BYTES_PER_S",
    "PCIE_BYTES_PER_S",
    "PLACEMENTS",
    "Call",
    "FitRow",
    "MemoryPlan",
    "MemoryPlanError",
    "PlannedRequest",
    "RequestShape",
    "available_bytes",
    "block_bytes",
    "check_plan",
    "component_tensor_bytes",
    "cogvideox_decode_peak_bytes",
    "decode_peak_bytes",
    "hunyuan15_decode_peak_bytes",
    "hunyuan_decode_peak_bytes",
    "wan_decode_peak_bytes",
    "fit_rank_key",
    "fit_ranking_reasons",
    "format_rows",
    "held_weights",
    "human_bytes",
    "make_call",
    "model_legend",
    "plan_memory",
    "plan_model",
    "plan_row",
    "request_shape",
    "smallest_fit",
    "tensor_bytes",
]
