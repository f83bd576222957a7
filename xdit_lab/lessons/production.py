"""From a notebook to production (tutorial 10): the same generation as `xdit-lab run` under torchrun.

run_argv(...), torchrun_argv(...)   `xdit-lab run` arguments from pipe(...) keyword arguments; torchrun
run_processes(commands, timeout_s)  start commands together, wait with a deadline, kill on timeout
read_run_images(folder)             the images a run wrote, as arrays, in report order
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..config import GRID

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
    for name in GRID:
        if getattr(config, name) > 1:
            argv += [f"--{name}", str(getattr(config, name))]
    if config.pipefusion > 1:
        argv += ["--warmup-steps", str(config.warmup_steps)]
        if config.num_patches:
            argv += ["--num-patches", str(config.num_patches)]
        if config.pipefusion_schedule != "drained":
            argv += ["--pipefusion-schedule", config.pipefusion_schedule]
    if config.comm_dtype is not None:
        argv += ["--comm-dtype", config.comm_dtype]
    for key, value in call_kwargs.items():
        if key in _FLAGS:
            argv += [_FLAGS[key], str(value)]
        else:
            argv += ["--option", f"{key}={json.dumps(value)}"]
    return argv


def torchrun_argv(
    nproc_per_node: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`, the kernel's own interpreter) up to the module it runs:
    append ["-m", "xdit_lab.cli", ...]. On one node, by default, `--standalone`: torchrun serves its rendezvous on
    a port it binds itself. Or a static rendezvous at master_addr:master_port, this node being node_rank, or
    (`rdzv_endpoint="host:port"`) torch's c10d rendezvous there, which ranks the nodes by their host names; its host
    (by name or address) serves the rendezvous and every node runs the same command."""
    neither = master_port is None and rdzv_endpoint is None
    if (master_port is not None and rdzv_endpoint is not None) or (neither and nnodes > 1):
        raise ValueError(
            "torchrun_argv needs master_port= (a static rendezvous) or rdzv_endpoint= (c10d), one of them"
            + (" on several nodes" if nnodes > 1 else "")
        )
    if neither:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc_per_node)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes)]
    if rdzv_endpoint is not None:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", "xdit-lab"]
        return torchrun + ["--nproc_per_node", str(nproc_per_node), *rendezvous]
    node = ["--node_rank", str(node_rank), "--nproc_per_node", str(nproc_per_node)]
    return torchrun + node + ["--master_addr", master_addr, "--master_port", str(master_port)]


def run_processes(
    commands: list[list[str]], timeout_s: float, *, envs: list[dict] | None = None, cpus: list[set] | None = None
) -> list[dict]:
    """Start every command at once (the nodes of one job must rendezvous), wait for all with one
    deadline; on timeout kill them all. `envs[i]` adds environment variables to command i, `cpus[i]`
    pins it (and its children) to those CPU cores (Linux), as a node has cores of its own. One dict
    per command: returncode, output (stdout + stderr), timed_out."""
    procs = []
    for i, command in enumerate(commands):
        env = {**os.environ, **envs[i]} if envs and envs[i] else None
        cores = cpus[i] if cpus else None
        pin = (
            (lambda cores=cores: os.sched_setaffinity(0, cores)) if cores and hasattr(os, "sched_setaffinity") else None
        )
        procs.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=pin
            )
        )
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
