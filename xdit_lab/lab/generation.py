"""lab.generate: many prompts drawn from a notebook, each image written and recorded as it is made, resumable.

    lab.load("digits", ParallelConfig(dp=2))
    report = lab.generate("prompts.txt", output="out/", images_per_prompt=4, batch_size=8, seed=0)
    report = lab.generate(["a handwritten 3", "a handwritten 7"], output="out2/", num_inference_steps=10)

It is `xdit-lab run --prompts` on the Lab's engines, step for step (run.py): the images asked for come from the
notebook (a prompts file read by prompts_file.read_prompts_file, or a list), the writing rank (rank 0) opens the
output folder (output_folder.open_run: a rerun with the same arguments draws what is not recorded yet, other
arguments are refused by name), then every batch is one call to the engines, so a progress bar moves between
batches, each call has the Lab's timeout, and a stopped cell leaves whole files and whole records behind:

    notebook   jobs ──> open (rank 0) ──> check (all) ──> draw batch 1 ──> draw batch 2 ──> ... ──> report (rank 0)
    engines                                               [rows over dp × cfg, like one call's]
"""

from __future__ import annotations

from pathlib import Path

from . import engine
from .errors import LabError


def generate(
    lab,
    prompts,
    output,
    *,
    images_per_prompt: int = 1,
    batch_size: int | None = None,
    seed: int = 0,
    negative_prompt: str | None = None,
    output_type: str = "pil",
    progress: bool = True,
    timeout_s: float | None = None,
    **call,
) -> dict:
    """Draw every image `prompts` (a prompts file's path, or a list of texts) asks for with the loaded pipeline,
    `batch_size` at a time (default: the dp degree), into `output`; return the report (report.json). `call` holds
    what `lab.session` takes besides the prompt (num_inference_steps, guidance_scale, height, width, the family's
    options); `timeout_s` bounds each batch. See run.run_prompts_file for ids, seeds and resuming."""
    from tqdm.auto import tqdm

    from ..prompts_file import prompt_list_jobs, read_prompts_file
    from ..run import run_identity

    if lab.loaded is None:
        raise LabError("nothing is loaded yet: call lab.load(name_or_path, config) first")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a whole number >= 1; got {batch_size!r}")
    from_file = isinstance(prompts, (str, Path))
    jobs = (read_prompts_file if from_file else prompt_list_jobs)(prompts, images_per_prompt, seed)
    source = str(prompts) if from_file else "prompts"
    config, output = lab.loaded.config, str(Path(output).expanduser().absolute())
    load_options = lab.loaded.options  # run.json records them as `xdit-lab run --prompts` does
    identity = run_identity(lab.loaded.name_or_path, jobs, config, call, negative_prompt, output_type, load_options)

    def on_engines(fn, *args, ranks=None):
        return lab.call(fn, *args, ranks=ranks, timeout_s=timeout_s, what="generate")

    done = set(on_engines(engine.open_generation, output, identity, ranks=[0])[0])
    on_engines(engine.check_generation, jobs, call, negative_prompt, source)
    pending = [job for job in jobs if job.id not in done]
    batch = batch_size or config.dp
    drawn = []
    with tqdm(total=len(jobs), initial=len(jobs) - len(pending), unit="image", disable=not progress) as bar:
        for first in range(0, len(pending), batch):
            rows = pending[first : first + batch]
            drawn.append(on_engines(engine.draw, rows, output, call, negative_prompt, output_type)[0])
            bar.update(len(rows))
    report = on_engines(
        engine.finish_generation,
        output,
        lab.loaded.name_or_path,
        jobs,
        len(done),
        drawn,
        batch,
        load_options,
        ranks=[0],
    )[0]
    report["prompts"] = source
    return report
