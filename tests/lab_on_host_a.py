"""What a notebook on host A runs to use engines on hosts A and B (tests/test_lab_hosts.py runs it inside host A's
namespace): the controller on A's address, two engines on each host started by ipyparallel's own SSH launcher, a
Lab connected to them, then a session per configuration. Written to `output` (torch.save): the rank table (text and
rows) and, per configuration, the latents and every rank's bytes per group and step, measured and closed-form.

    python tests/lab_on_host_a.py A_ADDRESS B_ADDRESS OUTPUT SSH_ARGS_JSON FOLDER B_NAMESPACE B_INTERFACE

Then two faults, each in the middle of a session: host B's link goes down (the step's collectives wait for B's
ranks), and B's engines are killed. Each time the call ends with an error within the Lab's timeout, B comes back
(its link up), and lab.restart() starts fresh engines over SSH and reloads: each fault's run is written too (the
error, how long it took, the latents after the restart).
"""

import json
import os
import signal
import subprocess
import sys
import time

import ipyparallel as ipp
import torch
from traitlets.config import Config

from xdit_lab import ParallelConfig
from xdit_lab.lab import Lab, LabError
from xdit_lab.lessons.families import output_latents
from xdit_lab.tiny import tiny_pipeline_kwargs

PROMPTS = ["a red cat", "a blue dog"]
CONFIGS = [ParallelConfig(cfg=2, ulysses=2), ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=3)]
CALL = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=3, negative_prompt=["", "a photo"])
LAB_TIMEOUT_S, COLLECTIVE_TIMEOUT_S = 60, 20
FAULT_TIMEOUT_S = 30  # the call that loses host B: named within it
STARTED = time.monotonic()


def _log(what):  # on stderr, which tests/test_lab_hosts.py shows when this fails: where the time went
    print(f"[{time.monotonic() - STARTED:6.1f} s] {what}", file=sys.stderr, flush=True)


def main(a_address, b_address, output, ssh_args, folder, b_namespace, b_interface):
    config = Config()  # as the README's "Several hosts" shows
    config.SSHEngineSetLauncher.engines = {a_address: 2, b_address: 2}
    config.SSHLauncher.ssh_args = config.SSHLauncher.scp_args = json.loads(ssh_args)
    config.SSHLauncher.remote_python = sys.executable  # the same environment on every host
    cluster = ipp.Cluster(engine_launcher_class="ssh", controller_ip=a_address, cluster_id="two-hosts", config=config)
    cluster.start_cluster_sync(n=4)
    _log("controller and 4 engines started over SSH")
    try:
        with Lab(4, cluster=cluster, timeout_s=LAB_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S) as lab:
            results = dict(table=repr(lab), ranks=[dict(row) for row in lab.ranks], runs={})
            _log("Lab connected")
            for parallel in CONFIGS:
                lab.load(folder, parallel)
                session = lab.session(PROMPTS, seed=0, **CALL).run()
                latents = output_latents(session.result(output_type="latent"))
                comm = [summary["comm"] for summary in session.summaries()]
                roles = [dict(row) for row in lab.ranks]
                results["runs"][parallel.short()] = dict(latents=latents, comm=comm, ranks=roles)
                _log(f"{parallel.short()} loaded and run")
            link = ["ip", "netns", "exec", b_namespace, "ip", "link", "set", b_interface]
            results["faults"] = {
                "link down": _host_lost(
                    lab,
                    folder,
                    lose=lambda: subprocess.run([*link, "down"], check=True, timeout=30),
                    back=lambda: subprocess.run([*link, "up"], check=True, timeout=30),
                ),
                "engines killed": _host_lost(lab, folder, lose=lambda: _kill_engines(b_namespace), back=lambda: None),
            }
        torch.save(results, output)
    finally:
        cluster.stop_cluster_sync()


def _host_lost(lab, folder, lose, back) -> dict:
    """`lose()` host B after the first step of a session: the rest of it fails by name; `back()`, a restart."""
    lab.load(folder, CONFIGS[0])
    session = lab.session(PROMPTS, seed=0, **CALL).step()
    lose()
    started = time.monotonic()
    try:
        session.run(timeout_s=FAULT_TIMEOUT_S)
        error = None
    except LabError as lost:
        error = str(lost)
    seconds = time.monotonic() - started
    _log(f"host B lost: the call ended in {seconds:.1f} s")
    back()
    lab.restart()  # fresh engines over SSH on both hosts, the last pipeline loaded again
    _log("restarted")
    latents = output_latents(lab.session(PROMPTS, seed=0, **CALL).run().result(output_type="latent"))
    _log("run again")
    return dict(error=error, seconds=seconds, latents=latents, ranks=[dict(row) for row in lab.ranks])


def _kill_engines(namespace):
    """SIGKILL every ipyparallel engine process in host B's namespace (its sshd stays)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30).stdout
    killed = []
    for pid in pids.split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"ipyparallel.engine" not in cmdline.read():
                    continue
            os.kill(int(pid), signal.SIGKILL)
            killed.append(int(pid))
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
            continue
    assert killed, f"no engine process in {namespace}"


if __name__ == "__main__":
    main(*sys.argv[1:])
