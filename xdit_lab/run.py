"""The production run: what `xdit-lab run` does on every rank that torchrun starts.

    torchrun --nproc_per_node 4 -m xdit_lab.cli run --model PATH --prompt "a cat" \\
        --ulysses 2 --cfg 2 --steps 20 --seed 0 --output out/

It goes through the same load_pipeline and DenoiseSession as a notebook. The first rank of
the configuration writes the images and `report.json` (configuration, timings per phase,
memory per rank, bytes communicated per group: over the run, and per phase and denoising step); every file is written to a temporary name and
renamed, so a failed run leaves no half-written file behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from . import comm
from .config import ParallelConfig
from .distributed import current_info, init_distributed
from .mesh import WORLD
from .models import StepCache
from .pipeline import load_pipeline, resolve_dtype
from .request_memory import rank_memory


def atomic_write(path: Path, write) -> Path:
    """Call write(temporary_path), then rename it to `path`: readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def run_generation(
    model: str,
    prompts: list[str],
    config: ParallelConfig,
    output_dir,
    *,
    negative_prompts=None,
    steps=None,
    guidance_scale=None,
    seed: int = 0,
    height=None,
    width=None,
    dtype: str = "auto",
    output_type: str = "pil",
    progress: bool = True,
    timeout_s: float = 600,
    options: dict | None = None,
    cache_threshold: float | None = None,
    compile: bool = False,
    shard_weights: bool = False,
    on_host: tuple[str, ...] = (),
    quantization: str | None = None,
) -> dict | None:
    """Generate on this rank; the configuration's first rank writes the outputs and returns the report.
    `cache_threshold` turns on a StepCache with that threshold; `compile` compiles the transformer;
    `shard_weights`, `on_host` and `quantization` place and store the weights as load_pipeline's arguments of
    those names do; `dtype` "auto" is bfloat16 on a GPU, float32 on a CPU (the report names the one it ran in)."""
    init_distributed(timeout_s=timeout_s)
    cache = None if cache_threshold is None else StepCache(cache_threshold)
    pipe = load_pipeline(
        model,
        config,
        torch_dtype=dtype,
        progress=progress,
        cache=cache,
        compile=compile,
        shard_weights=shard_weights,
        on_host=on_host,
        quantization=quantization,
    )
    if not pipe.active:
        return None  # a configuration smaller than the world: this rank sits out
    with comm.comm_log() as log:
        result = pipe(
            prompts,
            negative_prompt=negative_prompts,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
            seed=seed,
            output_type=output_type,
            **(options or {}),
        )
    mine = dict(
        rank=current_info().rank,
        mesh=str(pipe.mesh),
        device=str(pipe.device),
        memory=rank_memory(pipe),
        bytes_out_by_group=log.bytes_by_group(),  # the whole run
        bytes_out_by_phase=dict(encode=result.comm_encode, per_step=result.comm_per_step, decode=result.comm_decode),
        timings=result.timings,
        compiled_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],  # 1 when --compile took it whole
    )
    ranks = comm.all_gather_object(mine, pipe.mesh, WORLD, tag="report")
    if pipe.mesh.group_rank(WORLD) != 0:
        return None
    files = _write_outputs(result, pipe.recipe, Path(output_dir), output_type)
    report = dict(
        model=str(model),
        pipeline=type(pipe.diffusers_pipeline).__name__,
        config=config.__dict__,
        config_short=config.short(),
        prompts=prompts,
        negative_prompts=negative_prompts,
        seed=seed,
        steps=len(result.timings["steps"]),
        dtype=str(resolve_dtype(dtype, pipe.device)).removeprefix("torch."),
        outputs=files,
        timings=result.timings,
        cache_threshold=cache_threshold,
        compiled=compile,
        shard_weights=shard_weights,
        on_host=list(on_host),
        quantization=quantization,
        cache_skips=result.cache_skips,
        memory_plan={
            "per_rank_bytes": pipe.memory_plan.per_rank_bytes,
            "component_bytes": pipe.memory_plan.component_bytes,
            "activation_bytes": pipe.memory_plan.activation_bytes,
        },
        ranks=ranks,
    )
    atomic_write(Path(output_dir) / "report.json", lambda p: p.write_text(json.dumps(report, indent=2, default=str)))
    return report


def _write_outputs(result, recipe, output_dir: Path, output_type: str) -> list[str]:
    images = result.frames if hasattr(result, "frames") else result.images
    written = []
    if output_type == "latent":
        path = atomic_write(output_dir / "latents.pt", lambda p: torch.save(images.cpu(), p))
        return [path.name]
    for i, image in enumerate(images):
        if isinstance(image, list):  # a video: its frames as one animated GIF
            name = f"{i:03d}.gif"
            atomic_write(
                output_dir / name,
                lambda p, frames=image: frames[0].save(
                    p, format="GIF", save_all=True, append_images=frames[1:], duration=125, loop=0
                ),
            )
        else:
            name = f"{i:03d}.png"
            atomic_write(output_dir / name, lambda p, picture=image: picture.save(p, format="PNG"))
        written.append(name)
    return written
