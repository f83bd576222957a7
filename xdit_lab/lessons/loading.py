"""Memory and loading, seen from the inside (tutorial 08): what a rank holds, what mmap maps.

    header_block_bytes(folder)          transformer bytes and per-block bytes from a safetensors header
    rank_weights(state)                 (engine) what this rank holds: parameter bytes, blocks, active or idle
    mapped_files(), read_bytes()        what this process has mapped, how much it read with read()
    mmap_refused()                      a context in which safetensors refuses mmap (as some file systems do)
    mmap_demo(path)                     one safetensors file read through mmap, then with mmap refused
    load_with_mmap_refused(state, ...)  (engine) load_pipeline with mmap refused, then generate
    planned_and_held(state, n)          (engine) latents, conditioning, stale K/V: the request's plan and what the rank holds
    step_peak(state)                    (engine) what the next step allocates at its peak and frees again (not planned)
    planned_totals(state, counts)       (engine) bytes per rank the request's plan gives for each number of prompts

Engine-side functions take the Lab's state dict (`lab.call(fn, ...)`) and return small dicts.
Nothing here owns any math: loading is the package's own load_pipeline.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch


def header_block_bytes(folder, component: str = "transformer", dtype: torch.dtype | None = torch.float32) -> dict:
    """From the safetensors headers of `folder/component` alone (no weight read): the component's
    bytes, the bytes of its transformer blocks, and of each block, as loaded in `dtype`."""
    from ..plan import block_bytes, component_tensor_bytes

    tensors = component_tensor_bytes(Path(folder) / component, dtype)
    blocks, _ = block_bytes(tensors, json.loads((Path(folder) / component / "config.json").read_text()))
    return dict(
        component_bytes=sum(tensors.values()),
        block_bytes=sum(blocks.values()),
        per_block={f"transformer_blocks.{i}": size for i, size in sorted(blocks.items())},
    )


def rank_weights(state: dict) -> dict:
    """(engine) What this rank holds: active or idle, parameter bytes per component, the bytes of
    its transformer blocks, which blocks (PipeFusion stage) and the memory plan's share."""
    pipe = state.get("pipe")
    if pipe is None:
        raise RuntimeError("no pipeline is loaded on this engine: call lab.load(...) first")
    out = dict(
        rank=state["rank"],
        active=pipe.active,
        plan_per_rank_bytes=dict(pipe.memory_plan.per_rank_bytes),
        parameter_bytes={},
        block_bytes=0,
        blocks=None,
    )
    if not pipe.active:
        return out
    for name, component in pipe.diffusers_pipeline.components.items():
        if isinstance(component, torch.nn.Module):
            out["parameter_bytes"][name] = sum(p.numel() * p.element_size() for p in component.parameters())
    transformer = pipe.diffusers_pipeline.transformer
    blocks = [
        p
        for name in ("transformer_blocks", "single_transformer_blocks")
        for p in getattr(transformer, name, torch.nn.ModuleList()).parameters()
    ]
    out["block_bytes"] = sum(p.numel() * p.element_size() for p in blocks)
    stage = getattr(transformer, "_xdit_lab_stage_blocks", None)  # (start, stop, total) when loaded as a stage
    out["blocks"] = (
        list(stage) if stage else [0, len(transformer.transformer_blocks), len(transformer.transformer_blocks)]
    )
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
            raise RuntimeError("Unable to mmap 1234 bytes from file (refused by xdit_lab.lessons.loading.mmap_refused)")

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
    from ..safetensors_io import read_safetensors_header

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
    return dict(
        file_bytes=path.stat().st_size,
        tensors=len(keys),
        tensor_bytes=tensor_total,
        mapped_while_open=mapped_while_open,
        mapped_while_tensors_live=mapped_while_tensors_live,
        mapped_after_release=str(path) in mapped_files(),
        mmap_read_bytes=mmap_read,
        plain_read_bytes=plain_read,
        refusals=dict(refusals),
        same_tensors=same,
    )


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


def planned_and_held(state: dict, prompts: int) -> dict:
    """(engine) After a step of the Lab's session of `prompts` prompts: what the request's memory plan
    (pipe.memory_plan_for) gives for the latents, the conditioning and PipeFusion's stale K/V, and
    what this rank holds of each, counted tensor by tensor; the plan's total and table."""
    from ..models import parallel_state
    from ..plan.loaded import held_bytes

    pipe, prepared = state["pipe"], state["session"].prepared
    plan = pipe.memory_plan_for(prompts)

    held = dict(latents=held_bytes(prepared.latents), conditioning=held_bytes(prepared.conditioning))
    held.update(parallel_state(pipe.diffusers_pipeline.transformer).strategy.report().kept_bytes)  # stale K/V
    planned = {name: plan.activation_bytes[name][1] for name in held}
    return dict(planned=planned, held=held, total=plan.total_per_rank, table=plan.table())


def step_peak(state: dict) -> int | None:
    """(engine) The most bytes the Lab session's next step allocates at once and frees again (its
    activations, the scheduler's new latents), measured tensor by tensor (lab.measure.PeakTensorBytes):
    not held between steps, so not in the memory plan."""
    from ..lab.measure import PeakTensorBytes

    if state.get("session") is None:  # an idle rank steps nothing
        return None
    with PeakTensorBytes() as meter:
        state["session"].step()
    return meter.peak


def planned_totals(state: dict, prompt_counts: list[int]) -> dict[int, dict]:
    """(engine) For each number of prompts, the request's memory plan on this rank: its total, and
    the latents and conditioning in it (the same on every rank, PipeFusion or not)."""
    totals = {}
    for n in prompt_counts:
        plan = state["pipe"].memory_plan_for(n)
        request = sum(plan.activation_bytes[name][1] for name in ("latents", "conditioning"))
        totals[n] = dict(total=plan.total_per_rank, latents_and_conditioning=request)
    return totals
