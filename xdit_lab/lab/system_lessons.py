"""Helpers for the system tutorials (08 memory and loading, 09 measuring, 10 production, 11 families).

Small pure functions: the engine-side ones take the Lab's state dict (`lab.call(fn, ...)`) and
return small dicts; the others read files, build command lines or reduce timings. Nothing here
owns any math: loading, timing and generating are the package's own load_pipeline,
PhaseTimings and DenoiseSession.

    header_block_bytes(folder)          transformer bytes and per-block bytes from a safetensors header
    rank_weights(state)                 (engine) what this rank holds: parameter bytes, blocks, active or idle
    mapped_files(), read_bytes()        what this process has mapped, how much it read with read()
    mmap_refused()                      a context in which safetensors refuses mmap (as some file systems do)
    mmap_demo(path)                     one safetensors file read through mmap, then with mmap refused
    load_with_mmap_refused(state, ...)  (engine) load_pipeline with mmap refused, then generate
    vae_decoder_calls(state)            (engine) how often the VAE's decoder ran on this rank
    timed_lab_runs(lab, prompts, ...)   warm-up runs, then timed runs of a Lab session
    phase_medians(timings)              the median of every phase over runs
    run_argv(...), torchrun_argv(...)   `xdit-lab run` arguments from pipe(...) keyword arguments; torchrun
    run_processes(commands, timeout_s)  start commands together, wait with a deadline, kill on timeout
    read_run_images(folder)             the images a run wrote, as arrays, in report order
    family_call_kwargs(family, steps)   call arguments for a tiny pipeline, real CFG for every family
    output_latents(output)              .frames (video) or .images of a pipeline output
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from ..config import DEGREES

# ---- 08: memory and loading ---------------------------------------------------------------------------

def header_block_bytes(folder, component: str = "transformer", dtype: torch.dtype | None = torch.float32) -> dict:
    """From the safetensors headers of `folder/component` alone (no weight read): the component's
    bytes, the bytes of its transformer blocks, and of each block, as loaded in `dtype`."""
    from ..memory import block_bytes, component_tensor_bytes

    tensors = component_tensor_bytes(Path(folder) / component, dtype)
    blocks, _ = block_bytes(tensors)
    return dict(component_bytes=sum(tensors.values()), block_bytes=sum(blocks.values()),
                per_block={f"transformer_blocks.{i}": size for i, size in sorted(blocks.items())})


def rank_weights(state: dict) -> dict:
    """(engine) What this rank holds: active or idle, parameter bytes per component, the bytes of
    its transformer blocks, which blocks (PipeFusion stage) and the memory plan's share."""
    pipe = state.get("pipe")
    if pipe is None:
        raise RuntimeError("no pipeline is loaded on this engine: call lab.load(...) first")
    out = dict(rank=state["rank"], active=pipe.active, plan_per_rank_bytes=dict(pipe.memory_plan.per_rank_bytes),
               parameter_bytes={}, block_bytes=0, blocks=None)
    if not pipe.active:
        return out
    for name, component in pipe.diffusers_pipeline.components.items():
        if isinstance(component, torch.nn.Module):
            out["parameter_bytes"][name] = sum(p.numel() * p.element_size() for p in component.parameters())
    transformer = pipe.diffusers_pipeline.transformer
    blocks = [p for name in ("transformer_blocks", "single_transformer_blocks")
              for p in getattr(transformer, name, torch.nn.ModuleList()).parameters()]
    out["block_bytes"] = sum(p.numel() * p.element_size() for p in blocks)
    stage = getattr(transformer, "_xdit_lab_stage_blocks", None)  # (start, stop, total) when loaded as a stage
    out["blocks"] = list(stage) if stage else [0, len(transformer.transformer_blocks), len(transformer.transformer_blocks)]
    return out


def mapped_files(suffix: str = ".safetensors") -> list[str]:
    """Files whose name ends with `suffix` that this process has memory-mapped now (Linux /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if p.endswith(suffix))


def read_bytes() -> int | None:
    """Bytes this thread has asked for with read() so far (Linux: rchar of /proc/thread-self/io;
    None where there is no such file). Pages of a memory map are not read() and do not count."""
    for path in ("/proc/thread-self/io", "/proc/self/io"):
        try:
            with open(path) as f:
                return int(next(line for line in f if line.startswith("rchar:")).split()[1])
        except (OSError, StopIteration):
            continue
    return None


@contextlib.contextmanager
def mmap_refused():
    """Inside: safetensors refuses to map files ("Unable to mmap"), as on file systems without mmap or
    under an address-space limit; the loaders' fallbacks (plain reads) take over. Yields a dict counting
    the refusals per function. The same fault the tests inject (tests/test_session.py, test_pipefusion.py)."""
    import safetensors
    import safetensors.torch

    refusals = {"safe_open": 0, "load_file": 0}
    real = safetensors.safe_open, safetensors.torch.load_file

    def refuse(name):
        def refused(*args, **kwargs):
            refusals[name] += 1
            raise RuntimeError("Unable to mmap 1234 bytes from file (refused by xdit_lab.lab.system_lessons.mmap_refused)")
        return refused

    safetensors.safe_open, safetensors.torch.load_file = refuse("safe_open"), refuse("load_file")
    try:
        yield refusals
    finally:
        safetensors.safe_open, safetensors.torch.load_file = real


def mmap_demo(path) -> dict:
    """Read every tensor of one safetensors file twice in this process: through safetensors' mmap
    (the file appears in the process's memory maps, and stays there while tensors backed by the map
    live; pages come in when touched, not through read()), then with mmap refused
    (xdit_lab.loading.read_tensors falls back to read() at the header's offsets)."""
    import gc

    from safetensors import safe_open

    from ..loading import read_tensors
    from ..memory import read_safetensors_header

    path = Path(path).resolve()
    keys = list(read_safetensors_header(path))
    before = read_bytes()
    with safe_open(str(path), framework="pt") as f:
        mapped = {key: f.get_tensor(key) for key in keys}
        mmap_read = None if before is None else read_bytes() - before
        mapped_while_open = str(path) in mapped_files()
    del f
    mapped_while_tensors_live = str(path) in mapped_files()
    with mmap_refused() as refusals:
        before = read_bytes()
        plain = read_tensors(path, keys)
        plain_read = None if before is None else read_bytes() - before
    same = all(torch.equal(mapped[k], plain[k]) for k in keys)
    tensor_total = sum(t.numel() * t.element_size() for t in mapped.values())
    del mapped
    gc.collect()
    return dict(file_bytes=path.stat().st_size, tensors=len(keys), tensor_bytes=tensor_total,
                mapped_while_open=mapped_while_open, mapped_while_tensors_live=mapped_while_tensors_live,
                mapped_after_release=str(path) in mapped_files(), mmap_read_bytes=mmap_read,
                plain_read_bytes=plain_read, refusals=dict(refusals), same_tensors=same)


def load_with_mmap_refused(state: dict, name_or_path, config, prompts, seed: int, call_kwargs: dict) -> dict:
    """(engine, every rank) load_pipeline with mmap refused on this rank, then one generation with it.
    Returns the refusals and, from rank 0, the final latents (on the CPU). The Lab's own pipeline stays."""
    from ..pipeline import load_pipeline

    with mmap_refused() as refusals:
        pipe = load_pipeline(name_or_path, config, progress=False)
    out = dict(rank=state["rank"], refusals=dict(refusals), active=pipe.active, latents=None)
    if pipe.active:
        latents = pipe(prompts, seed=seed, output_type="latent", **call_kwargs).images
        if state["rank"] == 0:
            out["latents"] = latents.detach().to("cpu")
    return out


# ---- 09: measuring -----------------------------------------------------------------------------------------

def vae_decoder_calls(state: dict) -> int | None:
    """(engine) How many times the VAE's decoder has run on this rank since this pipeline was loaded
    (a counting hook is added on first use; idle ranks answer None)."""
    pipe = state.get("pipe")
    if pipe is None or not pipe.active:
        return None
    decoder = pipe.diffusers_pipeline.vae.decoder
    if not hasattr(decoder, "_xdit_lab_calls"):
        decoder._xdit_lab_calls = 0

        def count(module, args):
            module._xdit_lab_calls += 1

        decoder.register_forward_pre_hook(count)
    return decoder._xdit_lab_calls


def timed_lab_runs(lab, prompts, *, runs: int, warmup: int = 1, seed: int = 0, output_type: str = "latent",
                   **call_kwargs) -> dict:
    """`warmup` untimed runs, then `runs` timed runs of lab.session(...).run().result(output_type):
    rank 0's PhaseTimings of each, and the wall-clock seconds the notebook waited for each."""
    def one():
        start = time.perf_counter()
        output = lab.session(prompts, seed=seed, **call_kwargs).run().result(output_type=output_type)
        return output.timings, time.perf_counter() - start

    warm = [one() for _ in range(warmup)]
    timed = [one() for _ in range(runs)]
    return dict(warmup=[t for t, _ in warm], warmup_wall=[w for _, w in warm],
                runs=[t for t, _ in timed], wall=[w for _, w in timed])


def phase_medians(timings: list[dict]) -> dict:
    """The median over runs of every phase (encode, prepare, denoise, decode) and of a step."""
    if not timings:
        raise ValueError("no timed runs to take a median of")
    phases = {name: statistics.median(t[name] for t in timings) for name in ("encode", "prepare", "denoise", "decode")}
    phases["step"] = statistics.median(s for t in timings for s in t["steps"])
    return phases


# ---- 10: from notebook to production ----------------------------------------------------------------------

_FLAGS = {"num_inference_steps": "--steps", "guidance_scale": "--guidance", "height": "--height", "width": "--width"}


def run_argv(model, prompts, config, output, *, seed: int = 0, negative_prompt=None, **call_kwargs) -> list[str]:
    """`xdit-lab run` arguments (after the program name) for the generation that
    `lab.session(prompts, seed=seed, negative_prompt=..., **call_kwargs)` runs under `config`:
    steps, guidance and size have their own flags, every other pipeline argument is an --option."""
    argv = ["run", "--model", str(model), "--output", str(output), "--seed", str(seed), "--no-progress"]
    for prompt in [prompts] if isinstance(prompts, str) else prompts:
        argv += ["--prompt", prompt]
    if negative_prompt is not None:
        for negative in [negative_prompt] if isinstance(negative_prompt, str) else negative_prompt:
            argv += ["--negative-prompt", negative]
    for name in DEGREES:
        if getattr(config, name) > 1:
            argv += [f"--{name}", str(getattr(config, name))]
    if config.pipefusion > 1:
        argv += ["--warmup-steps", str(config.warmup_steps)]
        if config.num_patches:
            argv += ["--num-patches", str(config.num_patches)]
    for key, value in call_kwargs.items():
        if key in _FLAGS:
            argv += [_FLAGS[key], str(value)]
        else:
            argv += ["--option", f"{key}={json.dumps(value)}"]
    return argv


def torchrun_argv(nproc_per_node: int, *, nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
                  master_port: int) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`, the kernel's own interpreter) with a static
    rendezvous at master_addr:master_port, up to the module it runs: append ["-m", "xdit_lab.cli", ...]."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--nproc_per_node", str(nproc_per_node), "--master_addr", master_addr, "--master_port", str(master_port)]


def run_processes(commands: list[list[str]], timeout_s: float, *, envs: list[dict] | None = None,
                  cpus: list[set] | None = None) -> list[dict]:
    """Start every command at once (the nodes of one job must rendezvous), wait for all with one
    deadline; on timeout kill them all. `envs[i]` adds environment variables to command i, `cpus[i]`
    pins it (and its children) to those CPU cores (Linux), as a node has cores of its own. One dict
    per command: returncode, output (stdout + stderr), timed_out."""
    procs = []
    for i, command in enumerate(commands):
        env = {**os.environ, **envs[i]} if envs and envs[i] else None
        cores = cpus[i] if cpus else None
        pin = (lambda cores=cores: os.sched_setaffinity(0, cores)) if cores and hasattr(os, "sched_setaffinity") else None
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      preexec_fn=pin))
    deadline = time.monotonic() + timeout_s
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append(dict(returncode=proc.returncode, output=out, timed_out=False))
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    other.kill()
            out, _ = proc.communicate()
            results.append(dict(returncode=proc.returncode, output=out, timed_out=True))
    return results


def read_run_images(folder) -> list:
    """The images an `xdit-lab run` wrote to `folder`, as numpy arrays, in report.json's order."""
    import numpy as np
    from PIL import Image

    folder = Path(folder)
    report = json.loads((folder / "report.json").read_text())
    return [np.asarray(Image.open(folder / name)) for name in report["outputs"]]


# ---- 11: model families --------------------------------------------------------------------------------------

def family_call_kwargs(family: str, steps: int = 3) -> dict:
    """Call arguments for `save_tiny_pipeline(family)`'s pipeline, diffusers' and load_pipeline's alike:
    the tiny size, `steps` steps, and real classifier-free guidance (Flux: true_cfg_scale, since the
    tiny Flux has no guidance embedding), so that cfg 2 has two branches to split."""
    from ..tiny import tiny_pipeline_kwargs

    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=steps, guidance_scale=3.0)
    if family == "flux":
        kwargs["true_cfg_scale"] = 2.0
    return kwargs


def output_latents(output):
    """The latents of a pipeline output called with output_type="latent": .frames for video, else .images."""
    return output.frames if hasattr(output, "frames") else output.images
