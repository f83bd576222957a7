"""The notebook Lab on 2 CPU engines: ranks, distributed init, the tiny PixArt under CFG and on a
subset, stepping, the same images as `xdit-lab run`, clear errors, and recovery after a crash.

One cluster serves the whole module (starting one takes ~7 s); every call has a timeout, and the
fixture stops the cluster even when a test fails."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ipyparallel as ipp
import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist
from PIL import Image

from xdit_lab import ParallelConfig
from xdit_lab.lab import Lab, LabError, engine
from xdit_lab.lessons import production
from xdit_lab.testing import run_cli
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

PROMPTS = ["a red cat", "a blue dog"]
# The arguments of tests/test_run_cli.py, spelled for pipe.session(...)
KWARGS = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=3, guidance_scale=3.0, seed=7)


@pytest.fixture(scope="module")
def ipython_dir(tmp_path_factory):
    """Cluster files go to a fresh IPython directory, not the user's ~/.ipython."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("ipython")
        patch.setenv("IPYTHONDIR", str(path))
        yield path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))


@pytest.fixture(scope="module")
def lab(ipython_dir):
    with Lab(n=2, timeout_s=60, collective_timeout_s=30) as lab:
        yield lab


@pytest.fixture
def cfg2(lab, folder):
    if lab.config != ParallelConfig(cfg=2):
        lab.load(folder, ParallelConfig(cfg=2), progress=False)
    return lab


def test_rank_table_and_distributed_init(lab):
    assert [row["rank"] for row in lab.ranks] == [0, 1]
    assert [row["engine"] for row in lab.ranks] == sorted(lab.client.ids)
    assert {row["backend"] for row in lab.ranks} == {"gloo"} and {row["device"] for row in lab.ranks} == {"cpu"}
    assert [row["local_rank"] for row in lab.ranks] == [0, 1]
    assert len({row["pid"] for row in lab.ranks}) == 2
    text = lab.table()
    assert text.splitlines()[1].split() == ["rank", "engine", "host", "local_rank", "device", "pid", "role"]
    assert str(lab.ranks[1]["pid"]) in text and "<table>" in lab._repr_html_()
    # torch.distributed agrees with the Lab's rank table, and every engine runs one torch thread
    assert lab.call(dist.get_rank, state=False) == {0: 0, 1: 1}
    assert lab.call(dist.get_world_size, state=False) == {0: 2, 1: 2}
    assert lab.call(torch.get_num_threads, state=False) == {0: 1, 1: 1}


def test_stepping_equals_run(cfg2):
    stepped = cfg2.session(PROMPTS, **KWARGS)
    assert (stepped.step_index, stepped.done, stepped.num_steps) == (0, False, 3)
    timesteps = []
    while not stepped.done:
        timesteps.append(float(stepped.timestep))
        stepped.step()
    assert len(set(timesteps)) == 3 and stepped.step_index == 3 and stepped.timestep is None
    latents = stepped.latents
    assert tuple(latents.shape) == (2, 4, 8, 8)
    stepped_images = stepped.result(output_type="np").images

    ran = cfg2.session(PROMPTS, **KWARGS).run()
    assert torch.equal(ran.latents, latents)
    output = ran.result(output_type="np")
    assert np.array_equal(output.images, stepped_images)
    assert len(output.timings["steps"]) == 3 and len(output.comm_per_step) == 3
    summaries = ran.summaries()  # rank_summary(session) from every active rank
    assert [s["rank"] for s in summaries] == [0, 1] and {s["step"] for s in summaries} == {3}
    for s in summaries:  # cfg 2: each step's bytes per group, as comm_log measured them, equal the closed form
        measured = [{g: n for g, n in step.items() if n} for step in s["comm"]["measured"]]
        assert len(measured) == 3 and measured == s["comm"]["expected"], (s["rank"], measured, s["comm"]["expected"])
    with pytest.raises(LabError, match="newer lab.session"):
        stepped.step()  # its engines' session was replaced by `ran`


def test_lab_images_equal_the_cli(cfg2, folder, tmp_path):
    """The Lab's images under cfg 2 equal, bit for bit, those `xdit-lab run` writes for the same call on 2 ranks
    given torchrun's environment (run_cli). torchrun itself runs this job once, as test_run_cli's one-node
    reference; here it is the CLI's code against the Lab's, which that reference does not compare."""
    output = tmp_path / "cli"
    call = {k: v for k, v in KWARGS.items() if k != "seed"}
    argv = production.run_argv(folder, PROMPTS, ParallelConfig(cfg=2), output, seed=KWARGS["seed"], **call)
    # Two cores for the two ranks, so each runs one torch thread as the engines do (thread counts
    # can change the order of float sums, and the comparison below is exact).
    cpus = set(sorted(os.sched_getaffinity(0))[:2]) if hasattr(os, "sched_getaffinity") else None
    with ThreadPoolExecutor(1) as pool:  # the Lab works while the CLI's ranks run
        cli = pool.submit(run_cli, argv, 2, timeout_s=180, cpus=cpus)
        images = cfg2.session(PROMPTS, **KWARGS).run().result().images
        job = cli.result()
    assert job.codes == [0, 0], job
    assert np.asarray(images[0]).std() > 0  # not a blank image that any two runs would agree on
    for i, image in enumerate(images):
        assert np.array_equal(np.asarray(image), np.asarray(Image.open(output / f"{i:03d}.png")))


def test_a_config_on_a_subset_of_the_engines(lab, folder):
    lab.load(folder, ParallelConfig(cfg=2), progress=False)
    reference = lab.session(PROMPTS, **KWARGS).run().result(output_type="latent").images
    lab.configure(ParallelConfig())
    assert [row["role"] for row in lab.ranks] == ["serial", "idle"] and "idle" in lab.table()
    session = lab.session(PROMPTS, **KWARGS).run()
    serial = session.result(output_type="latent").images
    assert [s["rank"] for s in session.summaries()] == [0]  # the idle engine has no session
    assert serial.shape == reference.shape
    assert (serial - reference).abs().max() <= 1e-4 * max(1.0, reference.abs().max().item())


def test_generate_writes_as_it_draws_resumes_and_equals_a_serial_run(lab, folder, tmp_path):
    """lab.generate over a list of prompts under dp 2 in batches of 4, then serially one per call: each image's
    latents equal within 1e-4 (its noise is its own seed's); a second call draws nothing, and a call with other
    arguments into the same folder is refused naming them."""
    prompts = [f"a {colour} cat" for colour in ("red", "blue", "green", "grey", "black", "white")]
    call = {k: v for k, v in KWARGS.items() if k != "seed"}
    lab.load(folder, ParallelConfig(dp=2), progress=False)
    dp2 = lab.generate(prompts, tmp_path / "dp2", batch_size=4, output_type="latent", progress=False, **call)
    assert (dp2["images"], dp2["drawn"], dp2["resumed_with"], dp2["config_short"]) == (6, 6, 0, "dp2")
    again = lab.generate(prompts, tmp_path / "dp2", batch_size=4, output_type="latent", progress=False, **call)
    assert (again["drawn"], again["resumed_with"]) == (0, 6)
    with pytest.raises(
        LabError, match=r"holds 6 image\(s\) of a run with other arguments \(call.num_inference_steps: 3 there, 4 now\)"
    ):
        lab.generate(prompts, tmp_path / "dp2", output_type="latent", **dict(call, num_inference_steps=4))

    lab.configure(ParallelConfig())
    lab.generate(prompts, tmp_path / "serial", batch_size=1, output_type="latent", progress=False, **call)
    records = [json.loads(line) for line in (tmp_path / "dp2" / "records.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [f"{i:05d}-0" for i in range(6)] and records[0]["config"] == "dp2"
    for record in records:
        drawn = torch.load(tmp_path / "dp2" / record["file"])
        serial = torch.load(tmp_path / "serial" / record["file"])
        assert (drawn - serial).abs().max() <= 1e-4 * serial.abs().max(), record["id"]
    first, second = (torch.load(tmp_path / "serial" / f"0000{i}-0.pt") for i in (0, 1))
    assert (first - second).abs().max() > 1e-2 * first.abs().max()  # the control: images differ, the bound can fail


def test_a_remote_error_is_a_short_lab_error(cfg2):
    with pytest.raises(LabError) as caught:
        cfg2.session(PROMPTS, **dict(KWARGS, height=30))
    message = str(caught.value)
    assert "ranks 0, 1" in message and "height 30 not a multiple of 4" in message
    assert "Traceback" not in message and len(message.splitlines()) <= 4
    assert "ValueError" in caught.value.tracebacks()
    assert cfg2.session(PROMPTS, **KWARGS).step().step_index == 1  # the Lab is still usable


def test_a_config_larger_than_the_engines_is_refused_before_any_call(lab, folder):
    """Refused with what fits 2 engines; keeping the configuration on more ranks is advised only where the model's
    heads would run it (a ulysses degree above this model's heads was advised its ranks, which then failed on the
    heads)."""
    with pytest.raises(ValueError, match="world size is 2") as fits:
        lab.load(folder, ParallelConfig(cfg=2, ulysses=2))
    assert "nproc_per_node 4" in str(fits.value)  # the control: this one the heads allow
    heads = json.loads((Path(folder) / "transformer" / "config.json").read_text())["num_attention_heads"]
    with pytest.raises(ValueError, match=f"{heads} attention heads cannot give each of ulysses {heads + 1}") as refused:
        lab.load(folder, ParallelConfig(ulysses=heads + 1))
    assert "world size is 2" in str(refused.value) and "nproc_per_node" not in str(refused.value)


def test_a_stuck_rank_and_a_dead_engine_are_named(cfg2):
    """A rank stuck in a collective is named when the Lab stops waiting, and refused as busy; an engine that exits
    through a Lab call (a segfault) is named as gone, with lab.restart() as the way out. The restart itself is
    tests/test_lab_robustness.py's, after each state it leaves here: an engine gone (killed mid-run) and an engine
    busy that takes no signal but SIGKILL (stopped mid-run), each restarted into the same latents as before the
    fault. A restart here would prove nothing more, at the price of two engines started and a pipeline loaded.
    The last test on this module's Lab: it leaves rank 1 dead, and the fixture's stop ends the cluster."""
    # Rank 0 alone enters a barrier: it waits for rank 1, and the Lab stops waiting after 2 s.
    with pytest.raises(LabError, match=r"rank 0 \(engine \d+ on .*\): no answer after 2 s") as caught:
        cfg2.call(dist.barrier, ranks=[0], state=False, timeout_s=2)
    assert "collective" in str(caught.value)
    with pytest.raises(LabError, match="rank 0 .* is still busy"):
        cfg2.session(PROMPTS, **KWARGS)

    old_engines = [row["engine"] for row in cfg2.ranks]
    crash = cfg2.client[old_engines[1]].apply_async(engine.crash)  # the process ends, as on a segfault
    with pytest.raises(ipp.error.RemoteError):
        crash.get(timeout=30)  # the controller has seen the engine die
    deadline = time.monotonic() + 30
    while old_engines[1] in cfg2.client.ids and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(LabError, match=r"rank 1 \(engine \d+ on .*\): the engine is gone") as caught:
        cfg2.session(PROMPTS, **KWARGS)
    assert "lab.restart()" in str(caught.value)


def test_connect_to_a_running_cluster(ipython_dir):
    """A cluster started elsewhere (here: by ipyparallel directly, as ipcluster or an MPI/SSH/Slurm
    launcher would) is joined with Lab(cluster_id=...), and lab.stop() leaves it running."""
    cluster = ipp.Cluster(n=1, cluster_id=f"xdit-lab-test-{os.getpid()}", controller_ip="127.0.0.1", log_level=30)
    try:
        cluster.start_cluster_sync()
        for _ in range(2):  # connecting again works: the first Lab left the process group on stop
            with Lab(cluster_id=cluster.cluster_id, timeout_s=60, collective_timeout_s=30) as lab:
                assert lab.world_size == 1 and lab.ranks[0]["backend"] == "gloo"
                assert lab.call(dist.get_world_size, state=False) == {0: 1}
            assert not lab.owns_cluster
        client = cluster.connect_client_sync()
        try:
            client.wait_for_engines(1, timeout=30)
            assert len(client.ids) == 1
        finally:
            client.close()
    finally:
        cluster.stop_cluster_sync()


# A Lab that is never stopped, in a process of its own that either exits or is killed outright.
NEVER_STOPPED = """
import json, os, sys, time
from xdit_lab.lab import Lab
from xdit_lab.lab.forkserver import FORK_SERVERS
lab = Lab(n=1, timeout_s=60, fork_engines=sys.argv[3] == "forked")
pids = dict(controller=lab.cluster.controller.process.pid, engines=[row["pid"] for row in lab.ranks],
            watchdog=lab._watchdog.pid, fork_servers=FORK_SERVERS.pids())
with open(sys.argv[2] + ".tmp", "w") as file:
    json.dump(pids, file)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
if sys.argv[1] == "kill":
    time.sleep(300)  # until the test kills this process
else:
    sys.stdin.readline()  # until the test says: exit
"""


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("end, engines", [("exit", "forked"), ("kill", "forked"), ("kill", "spawned")])
def test_the_engines_end_with_the_process_that_started_them(end, engines, tmp_path):
    """On a normal exit (a kernel shut down) the Lab's atexit handler stops it, before ipyparallel's
    own handler would, loudly. A process killed outright (nbval kills its kernels; so does an
    out-of-memory kill) runs no handler: the Lab's watchdog stops the engines and the controller,
    which ipyparallel started in sessions of their own and would otherwise outlive it. Forked engines (the CPU
    default) and their fork server end too; so do engines of ipyparallel's own launcher (GPU engines')."""
    pid_file = tmp_path / "pids.json"
    script = subprocess.Popen(
        [sys.executable, "-c", NEVER_STOPPED, end, str(pid_file), engines],
        text=True,
        env=dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython")),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pids = []
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and script.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pid_file.exists(), f"the Lab did not start: {script.poll()=}"
        started = json.loads(pid_file.read_text())
        cluster = [started["controller"], *started["engines"]]
        children = [child.pid for pid in cluster for child in psutil.Process(pid).children(recursive=True)]
        pids = [*cluster, *children, started["watchdog"], *started["fork_servers"]]
        assert children and all(running(pid) for pid in pids)  # children: the schedulers, each engine's nanny
        forked = [psutil.Process(pid).ppid() in started["fork_servers"] for pid in started["engines"]]
        assert forked == [engines == "forked"], (forked, started)  # the launcher asked for, and no other
        if end == "kill":
            script.kill()
        _, stderr = script.communicate("exit\n", timeout=60)
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in pids if running(pid)]
        assert not left, f"still running 30 s after the script ended ({end}): {left} of {started}"
        if end == "exit":
            assert script.returncode == 0, stderr[-3000:]
            assert "Stopping cluster" not in stderr  # ipyparallel's fallback did not have to act
    finally:
        script.kill()
        for pid in pids:  # leave nothing behind, whatever happened above
            if running(pid):
                os.kill(pid, signal.SIGKILL)
