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
import time
import wave
from pathlib import Path

import torch
import torch.distributed as dist

from . import comm
from .config import ParallelConfig
from .distributed import current_info, init_distributed, interface_variable
from .load_options import LoadOptions
from .mesh import WORLD
from .output_folder import RECORDS_FILE, OutputWriteError, append_record, atomic_write, check_output_folder, open_run
from .pipeline import load_pipeline, resolve_dtype
from .plan.loaded import rank_memory


class PeerTimeoutError(RuntimeError):
    """This rank waited --timeout seconds for a peer (to join the world, or in a collective) that never answered."""


def run_generation(
    model: str,
    prompts: list[str],
    config: ParallelConfig,
    output_dir,
    *,
    load_options: LoadOptions | None = None,
    negative_prompts=None,
    steps=None,
    guidance_scale=None,
    seed: int = 0,
    height=None,
    width=None,
    output_type: str = "pil",
    timeout_s: float = 600,
    options: dict | None = None,
    image_files: dict[str, list] | None = None,
) -> dict | None:
    """Generate on this rank; the configuration's first rank writes the outputs and returns the report.
    `load_options` (a LoadOptions: its dtype, cache, compile, placed, quantized or adapted weights, pipeline class,
    progress bars) go to load_pipeline as they are, and into the report as LoadOptions.to_record() writes them
    (its torch_dtype "auto" is bfloat16 on a GPU, float32 on a CPU: the report's `dtype` names the one it ran in).
    `options` are the family's call options (`pipe(..., **options)`); `image_files` maps
    the call's image arguments to files ({"image": ["cat.png"], "mask_image": ["mask.png"]}), read on every rank.
    A peer that does not answer within `timeout_s` (hung, or gone) ends in PeerTimeoutError, naming this
    rank, what it was waiting in and the peers it waited for."""
    load_options = LoadOptions() if load_options is None else load_options
    where = Waiting()
    try:
        init_distributed(timeout_s=timeout_s)
        if current_info().rank == 0:  # the rank that writes (the configuration's first); before any loading
            check_output_folder(output_dir)
        images = read_image_files(image_files)  # before loading too: a wrong path costs no load
        with comm.comm_log() as where.log:  # every collective this rank starts: the last one names its peers
            where.phase = "loading the pipeline"
            pipe = load_pipeline(model, config, load_options)
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
                    **images,
                )
            mine = dict(
                **_rank_record(pipe),
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
        dtype=str(resolve_dtype(load_options.torch_dtype, pipe.device)).removeprefix("torch."),
        load_options=load_options.to_record(),
        outputs=[],  # each file's name once it is in place
        complete=False,  # until report.json is written after every output
        timings=result.timings,
        image_files=file_identities(image_files),
        cache_skips=result.cache_skips,
        memory_plan={
            "per_rank_bytes": pipe.memory_plan.per_rank_bytes,
            "component_bytes": pipe.memory_plan.component_bytes,
            "activation_bytes": pipe.memory_plan.activation_bytes,
        },
        ranks=ranks,
    )
    write_outputs(result, Path(output_dir), output_type, report, audio_rate=audio_sampling_rate(pipe))
    return report


def audio_sampling_rate(pipe) -> int | None:
    """The samples a second of the waveform a pipeline's vocoder returns beside its video (LTX-2's), else None."""
    vocoder = getattr(pipe.diffusers_pipeline, "vocoder", None)
    return None if vocoder is None else int(vocoder.config.output_sampling_rate)


def run_prompts_file(
    model: str,
    prompts_file,
    config: ParallelConfig,
    output_dir,
    *,
    load_options: LoadOptions | None = None,
    images_per_prompt: int = 1,
    batch_size: int | None = None,
    negative_prompt: str | None = None,
    steps=None,
    guidance_scale=None,
    seed: int = 0,
    height=None,
    width=None,
    output_type: str = "pil",
    timeout_s: float = 600,
    options: dict | None = None,
    image_files: dict[str, list] | None = None,
) -> dict | None:
    """Draw every image a prompts file asks for (prompts_file.py), `batch_size` at a time on one loaded pipeline
    (default: the dp degree, one image per dp group), each written and recorded as soon as its batch is decoded;
    the configuration's first rank returns the report. A batch's rows split over dp × cfg as one call's do. Each
    image's noise comes from its own seed, so it is the same whatever the batch size, dp degree or resume point.

    Run again with the same output folder and arguments, it draws only what records.jsonl does not hold
    (output_folder.py); with other arguments it is refused, naming them, before anything loads. `negative_prompt`
    is used where a line gives none. The other arguments are run_generation's. The Lab's `lab.generate` runs the
    same steps from a notebook (check_prompts, draw_images, generation_report)."""
    from tqdm.auto import tqdm

    from .prompts_file import read_prompts_file

    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a whole number >= 1; got {batch_size!r}")
    load_options = LoadOptions() if load_options is None else load_options
    jobs = read_prompts_file(prompts_file, images_per_prompt, seed)
    call = dict(num_inference_steps=steps, guidance_scale=guidance_scale, height=height, width=width, **(options or {}))
    # the files by their bytes' digest, so that a rerun resumes only when they are the same pictures
    identity = run_identity(
        model, jobs, config, call | file_identities(image_files), negative_prompt, output_type, load_options
    )
    call |= read_image_files(image_files)
    where = Waiting()
    output_dir = Path(output_dir).expanduser()
    try:
        init_distributed(timeout_s=timeout_s)
        done = open_run(output_dir, identity) if current_info().rank == 0 else {}  # before any loading
        with comm.comm_log() as where.log:
            where.phase = "loading the pipeline"
            pipe = load_pipeline(model, config, load_options)
            if not pipe.active:
                return None
            where.phase, where.mesh = "checking the prompts", pipe.mesh
            check_prompts(pipe, jobs, call, negative_prompt, prompts_file)
            # what is left to draw is the first rank's to say: it reads the folder (one source of truth)
            todo = comm.all_gather_object([j.id for j in jobs if j.id not in done], pipe.mesh, WORLD, tag="resume")[0]
            pending = [job for job in jobs if job.id in set(todo)]
            writer = pipe.mesh.group_rank(WORLD) == 0
            batch = batch_size or config.dp
            drawn = []
            bar = tqdm(
                total=len(jobs),
                initial=len(jobs) - len(pending),
                unit="image",
                disable=not (load_options.progress and writer),
            )
            with bar:
                for first in range(0, len(pending), batch):
                    rows = pending[first : first + batch]
                    where.phase = f"drawing {rows[0].id} .. {rows[-1].id}"
                    drawn.append(
                        draw_images(pipe, rows, output_dir if writer else None, call, negative_prompt, output_type)
                    )
                    bar.update(len(rows))
            where.phase = "gathering the report"
            mine = _rank_record(pipe)
            ranks = comm.all_gather_object(mine, pipe.mesh, WORLD, tag="report")
    except Exception as error:
        if not waited_for_a_peer(error):
            raise
        raise PeerTimeoutError(where.describe(error, timeout_s)) from error
    if not writer:
        return None
    report = generation_report(pipe, model, config, jobs, len(jobs) - len(pending), drawn, batch, load_options)
    report.update(prompts_file=str(prompts_file), ranks=ranks)
    write_generation_report(output_dir, report)
    return report


# the LoadOptions fields that change what is drawn (a run resumed with others would mix two runs' images); how the
# weights are placed (sharded, on the host), compiled, bounded or shown changes where and how fast, not the images
DRAWN_BY = ("torch_dtype", "cache", "quantization", "lora", "pipeline_class")


def run_identity(
    model, jobs, config: ParallelConfig, call: dict, negative_prompt, output_type, load_options: LoadOptions
) -> dict:
    """What a run into a folder draws (output_folder.open_run keeps it in run.json): the model, the images (their
    ids, texts and seeds), the call, the load options that change the images (DRAWN_BY), and the configuration but
    its dp degree, which changes who draws an image, not what is drawn."""
    from .prompts_file import prompts_digest

    record = load_options.to_record()

    return json.loads(
        json.dumps(
            dict(
                model=str(model),
                images_sha256=prompts_digest(jobs),
                images=len(jobs),
                call=call,
                negative_prompt=negative_prompt,
                output_type=output_type,
                load_options={name: record[name] for name in DRAWN_BY},
                # tp 1 left out: a folder started before tp existed is the same run
                config={k: v for k, v in config.__dict__.items() if k != "dp" and (k, v) != ("tp", 1)},
            ),
            default=str,
        )
    )  # as run.json will read back: tuples as lists, objects by their repr


def check_prompts(pipe, jobs, call: dict, negative_prompt, source) -> None:
    """The call's own arguments checked once, then each prompt, on every rank alike: one the text encoder would
    cut is refused before anything is drawn, naming its line of `source` (the file, or the list)."""
    from .prompts_file import PromptsFileError

    fallback = negative_prompt if negative_prompt is not None else pipe.call_defaults.get("negative_prompt")
    pipe.request([jobs[0].prompt], negative_prompt=fallback, **call)
    for job in jobs:
        if job.image_index == 0:
            try:
                pipe.request([job.prompt], negative_prompt=job.negative_prompt or fallback, **call)
            except ValueError as error:  # it names "prompt 0" of its one-prompt call: say the line's
                why = str(error).replace("negative_prompt 0 ", "its negative prompt ")
                why = why.replace("prompt 0 ", "the prompt ")
                raise PromptsFileError(f"{source}:{job.line}: {why}") from None


def draw_images(pipe, rows, output_dir, call: dict, negative_prompt, output_type: str) -> dict:
    """One batch: the images of `rows` drawn in one call, each from a CPU generator of its own seed; where
    `output_dir` is given (the writing rank), each written whole and then recorded. Returns the batch's seconds
    per phase and the files written."""
    started = time.perf_counter()
    fallback = negative_prompt if negative_prompt is not None else pipe.call_defaults.get("negative_prompt")
    negatives = [job.negative_prompt or fallback for job in rows]
    session = pipe.session(
        [job.prompt for job in rows],
        negative_prompt=None if all(n is None for n in negatives) else [n or "" for n in negatives],
        generator=[torch.Generator("cpu").manual_seed(job.seed) for job in rows],
        **call,
    )
    result = session.run().result(output_type=output_type)
    timings = {phase: result.timings[phase] for phase in ("encode", "denoise", "decode")}
    files = []
    if output_dir is not None:
        images = result.frames if hasattr(result, "frames") else result.images
        for job, image in zip(rows, images):
            files.append(_write_image(Path(output_dir), job, image, pipe.config, timings, len(rows)))
    return dict(timings=timings, files=files, images=len(rows), seconds=time.perf_counter() - started)


def generation_report(
    pipe, model, config, jobs, resumed_with: int, drawn: list[dict], batch: int, load_options: LoadOptions
) -> dict:
    """The report of a prompts run: images asked, found done, drawn; the throughput (images over the seconds of the
    batches drawn, on this rank's clock, writes included) and the seconds per phase, summed over the batches; the
    dtype it ran in and the load options."""
    per_phase = {phase: sum(b["timings"][phase] for b in drawn) for phase in ("encode", "denoise", "decode")}
    seconds, images = sum(b["seconds"] for b in drawn), sum(b["images"] for b in drawn)
    return dict(
        model=str(model),
        pipeline=type(pipe.diffusers_pipeline).__name__,
        config=config.__dict__,
        config_short=config.short(),
        images=len(jobs),
        resumed_with=resumed_with,  # images already in the folder when this run started
        drawn=images,
        batch_size=batch,
        seconds=seconds,
        images_per_second=images / seconds if seconds else None,
        seconds_per_phase=per_phase,
        dtype=str(resolve_dtype(load_options.torch_dtype, pipe.device)).removeprefix("torch."),
        load_options=load_options.to_record(),
        complete=True,
    )


def write_generation_report(output_dir: Path, report: dict) -> None:
    """report.json, unless nothing was drawn: a rerun with nothing left keeps the report of the run that drew."""
    if report["drawn"]:
        atomic_write(
            Path(output_dir) / "report.json", lambda p: p.write_text(json.dumps(report, indent=2, default=str))
        )


def _write_image(output_dir: Path, job, image, config, timings: dict, batch_images: int) -> str:
    """Write one image whole, then its record; a write that fails raises OutputWriteError naming the image (the
    records stay whole lines, so a rerun resumes from the images written before it)."""
    suffix, write = _one_output(image)
    name = f"{job.id}{suffix}"
    try:
        atomic_write(output_dir / name, write)
        append_record(
            output_dir,
            dict(
                id=job.id,
                prompt=job.prompt,
                negative_prompt=job.negative_prompt,
                seed=job.seed,
                line=job.line,
                file=name,
                config=config.short(),
                timings=dict(timings, batch_images=batch_images),
            ),
        )
    except OSError as error:
        records = output_dir / RECORDS_FILE
        recorded = len(records.read_text().splitlines()) if records.exists() else 0
        raise OutputWriteError(
            f"writing image {job.id} (line {job.line}) to {output_dir / name} failed ({error.strerror or error}); "
            f"{recorded} image(s) are written and recorded in records.jsonl. Free space or fix "
            f"{output_dir}, then run the same command again: it resumes where this one stopped"
        ) from error
    return name


def read_image_files(image_files: dict[str, list] | None) -> dict:
    """The call's image arguments from their files ({"image": ["cat.png"]}), each read by diffusers' load_image
    (as RGB): one file gives the image, several a list (Flux.2's reference images). A path that is not a readable
    image is refused naming the argument and the file."""
    from diffusers.utils import load_image
    from PIL import UnidentifiedImageError

    call = {}
    for argument, paths in (image_files or {}).items():
        images = []
        for path in paths:
            flag = "--" + argument.replace("_", "-")
            if not Path(path).is_file():
                raise FileNotFoundError(f"{flag} {path}: no such file; give the path of a PNG or JPEG image")
            try:
                images.append(load_image(str(path)))
            except (UnidentifiedImageError, OSError) as error:
                raise ValueError(f"{flag} {path} is not an image PIL can read ({error}); give a PNG or JPEG") from None
        call[argument] = images[0] if len(images) == 1 else images
    return call


def file_identities(image_files: dict[str, list] | None) -> dict:
    """Each image argument's files as (path, sha256 of the bytes), for report.json and run.json."""
    import hashlib

    return {
        argument: [dict(file=str(path), sha256=hashlib.sha256(Path(path).read_bytes()).hexdigest()) for path in paths]
        for argument, paths in (image_files or {}).items()
    }


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


def write_outputs(result, output_dir: Path, output_type: str, report: dict, audio_rate: int | None = None) -> None:
    """Each output written atomically (a video's audio, where the result has one, as a WAV at `audio_rate`
    samples a second beside it), its name added to report["outputs"] once it is in place, then
    report.json. A write that fails leaves report.json listing what was written before it (complete false,
    the error) and raises OutputWriteError."""

    def write_report():
        atomic_write(output_dir / "report.json", lambda p: p.write_text(json.dumps(report, indent=2, default=str)))

    name = None
    try:
        for name, write in _outputs(result, output_type, audio_rate):
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


def _outputs(result, output_type: str, audio_rate: int | None = None):
    """(file name, write(path)) for each output of a result: latents.pt, or one PNG per image, or one GIF per
    video (its frames, 8 a second); a result with audio (LTX-2's) adds each video's waveform as NNN.wav, or its
    audio latents as audio_latents.pt."""
    images = result.frames if hasattr(result, "frames") else result.images
    audio = getattr(result, "audio", None)
    if output_type == "latent":
        yield "latents.pt", lambda p: torch.save(images.cpu(), p)
        if audio is not None:
            yield "audio_latents.pt", lambda p: torch.save(audio.cpu(), p)
        return
    for i, image in enumerate(images):
        suffix, write = _one_output(image)
        yield f"{i:03d}{suffix}", write
        if audio is not None:
            yield f"{i:03d}.wav", lambda p, waveform=audio[i]: write_wav(p, waveform, audio_rate)


def write_wav(path, waveform, rate: int) -> None:
    """One waveform ([channels, samples] or [samples], in [-1, 1]) as 16-bit PCM WAV (Python's own wave module:
    every player reads it, and no dependency for one file kind)."""
    samples = torch.as_tensor(waveform).detach().float().cpu()
    samples = samples.reshape(1, -1) if samples.dim() == 1 else samples
    pcm = (samples.clamp(-1, 1) * 32767).round().to(torch.int16).T.contiguous()  # interleaved: frame by frame
    with wave.open(str(path), "wb") as out:
        out.setnchannels(samples.shape[0])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.numpy().astype("<i2").tobytes())  # WAV is little-endian


def _one_output(image) -> tuple[str, object]:
    """(suffix, write(path)) of one output: a video (a list of frames) as one animated GIF, 8 frames a second;
    an image as a PNG; latents (a tensor) as a .pt file."""
    if isinstance(image, torch.Tensor):
        return ".pt", lambda p: torch.save(image.detach().cpu().clone(), p)
    if isinstance(image, list):
        return ".gif", lambda p: image[0].save(
            p, format="GIF", save_all=True, append_images=image[1:], duration=125, loop=0
        )
    return ".png", lambda p: image.save(p, format="PNG")


def _rank_record(pipe) -> dict:
    """Where this rank ran, for report.json: its rank, mesh coordinates, device, host name, the network interface
    its collectives bound (distributed.init_distributed), and its memory."""
    import socket

    info = current_info()
    return dict(
        rank=info.rank,
        mesh=str(pipe.mesh),
        device=str(pipe.device),
        host=socket.gethostname(),
        interface=os.environ.get(interface_variable(info.backend)),  # None: what the host name resolves to
        memory=rank_memory(pipe),
    )
