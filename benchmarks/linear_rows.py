"""Work per rank through FLUX.1-dev's blocks at its real shapes, beside diffusers' context parallelism:
rows (tokens) through every nn.Linear of the blocks, their FLOPs, and the whole forward's FLOPs
(torch.utils.flop_counter.FlopCounterMode), on the `meta` device (no memory, no time).

    python benchmarks/linear_rows.py                      # 4096 image + 512 text tokens, ulysses 2 and 4
    python benchmarks/linear_rows.py --ranks 2 --image-tokens 4096 --text-tokens 512 --json out.json

FluxTransformer2DModel is built with FLUX.1-dev's constructor kwargs (REAL-MODELS.md: 19 double- and 38
single-stream blocks, 24 heads x 128) on `meta`, bf16, and run once per method in a process that is rank
0 of torch's fake process group (every collective returns at once; on meta nothing is computed anyway):

  serial                  diffusers' forward as it is
  diffusers ulysses<N>    diffusers' own context parallelism (ContextParallelConfig(ulysses_degree=N)):
                          splits the image and the text at the forward's input
  ours ulysses<N>         xdit_lab.parallelize: the joint text split like the image
  ours, text whole        the control: xdit_lab with the text whole on every rank
                          (controls=Controls(shards_text=False), the way before issue 42)

Rows are batch x tokens at each linear layer's input (forward pre-hooks); linear FLOPs are 2 x rows x
in_features x out_features. The target of issue 42: ours <= diffusers' per rank, at 2 and 4 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import multiprocessing
import os
import warnings
from unittest import mock

import torch

FLUX_1_DEV = dict(  # REAL-MODELS.md, "Constructor kwargs"
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)


def flux_1_dev(config: dict, image_tokens: int, text_tokens: int, device="meta"):
    """FLUX.1-dev's transformer (random weights) and one sample's inputs (random states), bf16, on `device`:
    `meta` holds nothing (for counting), a GPU holds the real 24 GB."""
    from diffusers import FluxTransformer2DModel

    side = int(image_tokens**0.5)
    if side * side != image_tokens:
        raise SystemExit(f"--image-tokens {image_tokens} is not a square number (e.g. 4096: 1024 x 1024 pixels)")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a float32 FLUX.1-dev (48 GB) would not fit beside it
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.device(device):
        grid = torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij")
        inputs = dict(
            hidden_states=torch.randn(1, image_tokens, config["in_channels"], dtype=torch.bfloat16),
            encoder_hidden_states=torch.randn(1, text_tokens, config["joint_attention_dim"], dtype=torch.bfloat16),
            pooled_projections=torch.randn(1, config["pooled_projection_dim"], dtype=torch.bfloat16),
            timestep=torch.tensor([0.5]),
            guidance=torch.tensor([3.5]),
            img_ids=torch.stack(grid, -1).reshape(image_tokens, 3),
            txt_ids=torch.zeros(text_tokens, 3),
            return_dict=False,
        )
    return model, inputs


def work(model, inputs) -> dict:
    """Rows and FLOPs through the blocks' linear layers, and the forward's FLOPs, of one forward."""
    from torch.utils.flop_counter import FlopCounterMode

    totals, handles = dict(rows=0, linear_flops=0), []

    def count(module, args):
        rows = args[0].shape[:-1].numel()
        totals["rows"] += rows
        totals["linear_flops"] += 2 * rows * module.in_features * module.out_features

    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        for module in block.modules():
            if isinstance(module, torch.nn.Linear):
                handles.append(module.register_forward_pre_hook(count))
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return dict(totals, forward_flops=counter.get_total_flops())


@contextlib.contextmanager
def _one_device_per_rank():
    """diffusers takes rank % torch.accelerator.device_count() for a rank's device (benchmarks/peers.py)."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def measure_world(world: int, image_tokens: int, text_tokens: int, config: dict) -> list[dict]:
    """In a fresh process, rank 0 of a fake world of `world` ranks: every method's work per rank."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from diffusers.utils import logging
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from xdit_lab import ParallelConfig, RankMesh, parallelize
    from xdit_lab.distributed import shutdown_distributed
    from xdit_lab.models import Controls

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model, inputs = flux_1_dev(config, image_tokens, text_tokens)
        peer = copy.deepcopy(model)
        with _one_device_per_rank():
            peer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        parallel = ParallelConfig(ulysses=world)
        mesh = RankMesh(parallel)
        ours = parallelize(copy.deepcopy(model), parallel, mesh)
        # the control: the text whole on every rank
        control = parallelize(copy.deepcopy(model), parallel, mesh, controls=Controls(shards_text=False))
        methods = {
            "serial": model,
            f"diffusers ulysses{world}": peer,
            f"ours ulysses{world}": ours,
            f"ours ulysses{world}, text whole (control)": control,
        }
        return [dict(world=world, method=name, **work(m, inputs)) for name, m in methods.items()]
    finally:
        shutdown_distributed()


def table(rows: list[dict]) -> str:
    lines = [
        "| ranks | method | rows per rank | linear TFLOPs per rank | forward TFLOPs per rank | rows / diffusers |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        peer = next(r for r in rows if r["world"] == row["world"] and r["method"].startswith("diffusers"))
        lines.append(
            f"| {row['world']} | {row['method']} | {row['rows']:,} | {row['linear_flops'] / 1e12:.2f} "
            f"| {row['forward_flops'] / 1e12:.2f} | {row['rows'] / peer['rows']:.3f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], choices=[2, 3, 4, 6, 8])
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--double", type=int, default=FLUX_1_DEV["num_layers"], help="double-stream blocks")
    parser.add_argument("--single", type=int, default=FLUX_1_DEV["num_single_layers"], help="single-stream blocks")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    config = dict(FLUX_1_DEV, num_layers=args.double, num_single_layers=args.single)
    spawn = multiprocessing.get_context("spawn")
    rows = []
    for world in args.ranks:
        with spawn.Pool(1) as pool:  # a fresh process per world: one fake group each
            rows += pool.apply(measure_world, (world, args.image_tokens, args.text_tokens, config))
    text = table(rows)
    print(text)
    for path, body in ((args.json, json.dumps(rows, indent=1)), (args.markdown, text)):
        if path:
            with open(f"{path}.partial", "w") as f:
                f.write(body + "\n")
            os.replace(f"{path}.partial", path)


if __name__ == "__main__":
    main()
