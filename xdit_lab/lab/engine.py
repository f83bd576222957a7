"""What the Lab runs on each engine: small functions over one state dict in the engine's namespace.

The Lab pushes a dict named `_xdit_lab` into every engine's namespace (its rank, world size,
local rank) and then applies these functions with `Reference("_xdit_lab")` as the first
argument, so the pipeline and the session live on the engine between calls, and a notebook
cell run again finds them there. Nothing here owns any math: it calls the same
`init_distributed`, `load_pipeline` and `DenoiseSession` as `xdit-lab run` under torchrun.

Only small things travel back: most functions answer from rank 0 alone (the latents and the
images are the same on every rank of a configuration), and idle ranks answer None.
"""

from __future__ import annotations

import os
import socket

STATE_NAME = "_xdit_lab"


def describe() -> dict:
    """Who this engine is, before it has a rank: host and process, and its address on the route to the controller
    (where every engine reaches it: the rank-0 engine's is the master address), None outside an engine."""
    from urllib.parse import urlparse

    from xdit_lab.distributed import route_source

    try:
        from ipyparallel.engine.app import IPEngine

        controller = urlparse(IPEngine.instance().registration_url).hostname
    except Exception:  # not in an ipyparallel engine
        controller = None
    address = route_source(controller) if controller else None
    return dict(host=socket.gethostname(), pid=os.getpid(), address=address)


def serve_store(state: dict) -> int:
    """Serve the world's rendezvous store from this engine (rank 0's) on a port the kernel picks, kept in the
    state until shutdown, and return the port: a port picked free and bound later could be taken in between."""
    from xdit_lab.distributed import serve_store

    state["store"] = serve_store(state["world_size"])
    return state["store"].port


def init(state: dict, master_addr: str, master_port: int, timeout_s: float, backend: str | None) -> dict:
    """Join the torch.distributed world (every engine enters this in the same non-blocking apply)."""
    import torch

    from xdit_lab.distributed import AGENT_STORE, init_distributed, interface_variable

    # What torchrun would have set: load_pipeline's memory plan reads LOCAL_WORLD_SIZE.
    for name in ("rank", "world_size", "local_rank", "local_world_size"):
        os.environ[name.upper()] = str(state[name])
    os.environ.update(AGENT_STORE)  # every engine joins the store rank 0 serves (serve_store), as a client
    info = init_distributed(
        backend,
        timeout_s,
        rank=state["rank"],
        world_size=state["world_size"],
        local_rank=state["local_rank"],
        local_world_size=state["local_world_size"],
        master_addr=master_addr,
        master_port=master_port,
    )
    if info.device.type == "cpu":
        torch.set_num_threads(1)  # engines share the host's cores; extra threads only contend
    state.update(pipe=None, session=None)
    # the interface its collectives bound: the one toward the master (init_distributed), None on one host
    return dict(
        backend=info.backend, device=str(info.device), interface=os.environ.get(interface_variable(info.backend))
    )


def shutdown(state: dict) -> None:
    """Drop the pipeline and leave the process group (the engine itself keeps running)."""
    from xdit_lab.distributed import shutdown_distributed

    state.update(pipe=None, session=None, serial_reference=None)
    shutdown_distributed()
    state["store"] = None  # rank 0's: after every rank has left the group


def load(state: dict, name_or_path, config, options) -> dict:
    """load_pipeline on every engine; idle ranks of a smaller configuration get an inactive pipeline."""
    from xdit_lab.model_folder import resolve_folder
    from xdit_lab.pipeline import load_pipeline

    reference = state.get("serial_reference")  # the explorer's serial run (explorer.serial_deviation)
    if reference is not None and reference["key"][0] != str(resolve_folder(name_or_path)):
        state["serial_reference"] = None  # of another model: freed before this one loads
    old = state.get("pipe")
    state.update(pipe=None, session=None)  # free the old pipeline before loading the next
    if old is not None:
        old.close()  # its process groups: every engine is in this call, so all close together
    del old  # the last reference: the old model is freed here (tests/test_gpu_true.py checks it with gc off)
    pipe = load_pipeline(name_or_path, config, options)
    state["pipe"] = pipe
    return dict(active=pipe.active, coords=pipe.mesh.coords)


def start_session(state: dict, args: tuple, kwargs: dict):
    state["session"] = None
    pipe = state.get("pipe")
    if pipe is None:
        raise RuntimeError("no pipeline is loaded on this engine: call lab.load(...) first")
    if pipe.active:  # the Lab draws each step in time (session.timeline()): recorded here, opt-in elsewhere
        state["session"] = pipe.session(*args, **{"timeline": True, **kwargs})
    return progress(state)


def progress(state: dict):
    """Where the session stands, from rank 0 only (every active rank is at the same step)."""
    session = state.get("session")
    if state["rank"] != 0 or session is None:
        return None
    timestep = session.timestep
    return dict(
        step_index=session.step_index,
        num_steps=session.num_steps,
        done=session.done,
        timestep=_to_cpu(timestep),
        cache_skips=list(session.cache_skips),
    )


def step(state: dict):
    if state.get("session") is not None:
        state["session"].step()
    return progress(state)


def run(state: dict):
    if state.get("session") is not None:
        state["session"].run()
    return progress(state)


def result(state: dict, output_type: str, return_dict: bool):
    """Decode on every active rank (the same code as pipe(...)); only rank 0's output travels back."""
    session = state.get("session")
    if session is None:
        return None
    output = session.result(output_type=output_type, return_dict=return_dict)
    if state["rank"] != 0:
        return None
    if not return_dict:
        return tuple(_to_cpu(item) for item in output)
    return dict(
        fields={key: _to_cpu(value) for key, value in output.items()},
        output_class=type(output),
        timings=output.timings,
        comm_per_step=output.comm_per_step,
        cache_skips=output.cache_skips,
    )


def latents(state: dict):
    session = state.get("session")
    return None if session is None else session.latents.detach().to("cpu")


def summaries(state: dict):
    """rank_summary(session) on this rank (None when idle or before a session)."""
    from xdit_lab.lab.summaries import rank_summary

    session = state.get("session")
    return None if session is None else rank_summary(session)


def timings(state: dict):
    """This rank's PhaseTimings as they stand, in seconds (None when idle or before a session)."""
    session = state.get("session")
    return None if session is None else session.timings.as_dict()


def step_spans(state: dict):
    """This rank's last step as comm_timeline rows (None when idle, or before a step)."""
    session = state.get("session")
    return None if session is None else session.last_step_spans


def memory(state: dict) -> dict:
    """This engine's device memory and process groups now, to check that reloading leaks neither."""
    import torch
    import torch.distributed as dist

    pipe = state.get("pipe")
    device = pipe.device if pipe is not None else None
    figures = dict(process_groups=len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        figures.update(
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            max_allocated=torch.cuda.max_memory_allocated(device),
        )
    return figures


def watch_transformer(state: dict) -> bool:
    """Keep a weak reference to the loaded transformer (for tests: does a reload free it?)."""
    import weakref

    pipe = state.get("pipe")
    transformer = pipe.diffusers_pipeline.transformer if pipe is not None and pipe.active else None
    state["watched"] = None if transformer is None else weakref.ref(transformer)
    return transformer is not None


def watched_alive(state: dict) -> bool | None:
    """Whether the transformer watch_transformer saw still exists (None when none was watched)."""
    watched = state.get("watched")
    return None if watched is None else watched() is not None


def open_generation(state: dict, output_dir: str, identity: dict) -> list[str]:
    """On the writing rank: start or resume a prompts run in output_dir (output_folder.open_run); the ids done."""
    from xdit_lab.output_folder import open_run

    return sorted(open_run(output_dir, identity))


def check_generation(state: dict, jobs: list, call: dict, negative_prompt, source: str) -> None:
    """Every prompt checked on every active rank, as `xdit-lab run --prompts` checks them (run.check_prompts)."""
    from xdit_lab.run import check_prompts

    if state["pipe"].active:
        check_prompts(state["pipe"], jobs, call, negative_prompt, source)


def draw(state: dict, rows: list, output_dir: str, call: dict, negative_prompt, output_type: str):
    """One batch of a prompts run (run.draw_images); the writing rank writes and records it, and answers."""
    from xdit_lab.mesh import WORLD
    from xdit_lab.run import draw_images

    pipe = state["pipe"]
    if not pipe.active:
        return None
    writer = pipe.mesh.group_rank(WORLD) == 0
    return draw_images(pipe, rows, output_dir if writer else None, call, negative_prompt, output_type)


def finish_generation(
    state: dict, output_dir: str, model, jobs: list, resumed_with: int, drawn: list, batch, load_options
):
    """On the writing rank: the report of a prompts run (run.generation_report), written as report.json."""
    from xdit_lab.run import generation_report, write_generation_report

    pipe = state["pipe"]
    report = generation_report(pipe, model, pipe.config, jobs, resumed_with, drawn, batch, load_options)
    write_generation_report(output_dir, report)
    return report


def crash(code: int = 1) -> None:
    """End this engine's process at once, as a segfault or an out-of-memory kill would (for tests)."""
    os._exit(code)


def _to_cpu(value):
    """GPU tensors would drag CUDA into the notebook's process: hand back CPU copies."""
    if hasattr(value, "detach") and hasattr(value, "to"):
        return value.detach().to("cpu")
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value
