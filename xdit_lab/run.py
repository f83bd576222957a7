"""The production run: what `xdit-lab run` does on every rank that torchrun starts.

    torchrun --nproc_per_node 4 -m xdit_lab.cli run --model PATH --prompt "a cat" \\
        --ulysses 2 --cfg 2 --steps 20 --seed 0 --output out/

It goes through the same load_pipeline and DenoiseSession as a notebook. The first rank of
the configuration writes the images and `report.json` (configuration, timings per phase,
memory per rank, bytes communicated per group: over the run, and per phase and denoising step); every file is written to a temporary name and
renamed, so a failed run leaves no half-written file behind.

What can go wrong, each a one-line error of `xdit-lab run`:
- the output folder: checked (created, a file written in it and removed) on the first rank before anything
  is loaded, so a typo in --output costs no generation (OutputFolderError);
- a write after the generation (a full disk, a name taken by a folder): OutputWriteError names the file, and
  the outputs written before it are listed in report.json, marked `"complete": false` with the error;
- a peer that hangs or dies: the collective this rank waits in gives up after --timeout, and
  PeerTimeoutError names this rank, the phase, the collective and the peers it waited for.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from . import comm
from .config import ParallelConfig
from .distributed import current_info, init_distributed
from .mesh import WORLD
from .models import StepCache
from .pipeline import load_pipeline, resolve_dtype
from .request_memory import rank_memory


class OutputFolderError(ValueError):
    """--output names a folder this rank cannot create or write in (found before anything is loaded)."""


class OutputWriteError(OSError):
    """Writing an output failed after the generation; the message names the file and what was written."""


class PeerTimeoutError(RuntimeError):
    """This rank waited --timeout seconds for a peer (to join the world, or in a collective) that never answered."""


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


def check_output_folder(output_dir) -> Path:
    """The output folder, created if missing, proven writable by writing and removing a file in it."""
    folder = Path(output_dir).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputFolderError(f"--output {folder} is a file: give a folder for the images and report.json")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".xdit-lab-write-check.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise OutputFolderError(
            f"cannot write the outputs to {folder} ({error.strerror or error}): give --output a folder you can "
            f"write (it is created if missing)"
        ) from None
    return folder


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
    compile: bool | str = False,
    shard_weights: bool = False,
    on_host: tuple[str, ...] = (),
    quantization: str | None = None,
) -> dict | None:
    """Generate on this rank; the configuration's first rank writes the outputs and returns the report.
    `cache_threshold` turns on a StepCache with that threshold; `compile` compiles the transformer;
    `shard_weights`, `on_host` and `quantization` place and store the weights as load_pipeline's arguments of
    those names do; `dtype` "auto" is bfloat16 on a GPU, float32 on a CPU (the report names the one it ran in).
    A peer that does not answer within `timeout_s` (hung, or gone) ends in PeerTimeoutError, naming this
    rank, what it was waiting in and the peers it waited for."""
    where = Waiting()
    try:
        init_distributed(timeout_s=timeout_s)
        if current_info().rank == 0:  # the rank that writes (the configuration's first); before any loading
            check_output_folder(output_dir)
        with comm.comm_log() as where.log:  # every collective this rank starts: the last one names its peers
            where.phase = "loading the pipeline"
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
            where.phase, where.mesh = "generating", pipe.mesh
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
                bytes_out_by_phase=dict(
                    encode=result.comm_encode, per_step=result.comm_per_step, decode=result.comm_decode
                ),
                timings=result.timings,
                compiled_graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],  # 1 when compiled whole
            )
            where.phase = "gathering the report"
            ranks = comm.all_gather_object(mine, pipe.mesh, WORLD, tag="report")
    except Exception as error:
        if not waited_for_a_peer(error):
            raise
        raise PeerTimeoutError(where.describe(error, timeout_s)) from error
    if pipe.mesh.group_rank(WORLD) != 0:
        return None
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
        outputs=[],  # each file's name once it is in place
        complete=False,  # until report.json is written after every output
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
    write_outputs(result, Path(output_dir), output_type, report)
    return report


def waited_for_a_peer(error: BaseException) -> bool:
    """Whether torch.distributed gave up on a peer: a store or backend timeout, or a peer's connection lost."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    signs = ("Timed out", "timed out", "wait timeout", "Connection closed by peer", "reset by peer")
    return isinstance(error, RuntimeError) and any(sign in text for sign in signs)


class Waiting:
    """Where this rank is (its phase, its mesh, the collectives it started), for the message of a peer timeout."""

    def __init__(self):
        self.phase, self.mesh, self.log = "joining the process group", None, None

    def describe(self, error: BaseException, timeout_s: float) -> str:
        rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        if dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        what = self.phase
        last = self.log.records[-1] if self.log is not None and self.log.records else None
        if last is not None and self.mesh is not None and self.phase != "loading the pipeline":
            peers = [r for r in self.mesh.group_ranks(last.group) if r != int(rank)]
            what += f", in the {last.group} {last.op}" + (f" ({last.tag})" if last.tag else "")
            what += f" with rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
        text = str(error).strip()
        cause = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
        return (
            f"rank {rank} of {world} gave up after --timeout {timeout_s:g} s {what}: a peer did not answer "
            f"({cause}). A rank that does not answer is hung or has died: see its own lines in the output; pass a "
            f"longer --timeout if a step of this model takes longer"
        )


def write_outputs(result, output_dir: Path, output_type: str, report: dict) -> None:
    """Each output written atomically, its name added to report["outputs"] once it is in place, then
    report.json. A write that fails leaves report.json listing what was written before it (complete false,
    the error) and raises OutputWriteError."""

    def write_report():
        atomic_write(output_dir / "report.json", lambda p: p.write_text(json.dumps(report, indent=2, default=str)))

    name = None
    try:
        for name, write in _outputs(result, output_type):
            atomic_write(output_dir / name, write)
            report["outputs"].append(name)
        name = "report.json"
        report["complete"] = True
        write_report()
    except OSError as error:
        why = error.strerror or str(error)
        listed = ""
        if name != "report.json":  # the outputs written so far, in a report that says it is partial
            report.update(complete=False, error=f"writing {name} failed: {why}")
            try:
                write_report()
                listed = " (listed in report.json, marked incomplete)"
            except OSError as report_error:
                listed = f"; report.json could not be written either ({report_error.strerror or report_error})"
        raise OutputWriteError(
            f"writing {output_dir / name} failed ({why}); written before it: "
            f"{', '.join(report['outputs']) or 'nothing'}{listed}. Free space or fix {output_dir}, and run again"
        ) from error


def _outputs(result, output_type: str):
    """(file name, write(path)) for each output of a result: latents.pt, or one PNG per image, or one GIF per
    video (its frames, 8 a second)."""
    images = result.frames if hasattr(result, "frames") else result.images
    if output_type == "latent":
        yield "latents.pt", lambda p: torch.save(images.cpu(), p)
        return
    for i, image in enumerate(images):
        if isinstance(image, list):  # a video: its frames as one animated GIF
            yield (
                f"{i:03d}.gif",
                lambda p, frames=image: frames[0].save(
                    p, format="GIF", save_all=True, append_images=frames[1:], duration=125, loop=0
                ),
            )
        else:
            yield f"{i:03d}.png", lambda p, picture=image: picture.save(p, format="PNG")
