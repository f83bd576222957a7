"""The Lab across two hosts (tests/two_hosts.py: network namespaces with host names of their own, joined by a
veth pair), its engines started by ipyparallel's own SSH launcher against an sshd on each host, the notebook on
host A (tests/lab_on_host_a.py, run inside A's namespace): the rank table shows both hosts, each engine's local
rank and the interface its collectives bound; the master address is A's address as B reaches it; cfg2·ulysses2
(the Ulysses pairs within a host) and pf2·ulysses2 (one stage per host) equal the same configurations on one host,
latents and bytes per group and step. Host B lost in the middle of a session (its link down, or its engines killed)
ends the call with an error naming B within the call's timeout; with B back, lab.restart() starts fresh engines on
both hosts and the run is the same again. Skipped, saying why, where namespaces or sshd cannot be had."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from forward_traffic import session_traffic
from two_hosts import ssh_servers, two_hosts

from xdit_lab import RankMesh, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from lab_on_host_a import CALL, CONFIGS, FAULT_TIMEOUT_S, PROMPTS  # noqa: E402 (the script's own, beside this file)


def _one_host(folder):
    """The same configurations on 4 ranks of this host: latents and each step's bytes per group."""
    runs = {}
    for config in CONFIGS:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        session = pipe.session(PROMPTS, seed=0, **CALL).run()
        latents = output_latents(session.result(output_type="latent"))
        runs[config.short()] = dict(latents=latents, moved=[step["moved"] for step in session_traffic(session)])
        pipe.close()
    return runs


# The script took 344 s beside the other worker on a VM where it takes 190 s alone; CI's VMs differ by up to 2x.
# Each call inside it has its own limit (the Lab's 60 s, the lost host's 30 s), so these only bound the whole; the
# test's own limit leaves room for the script's and the one-host run's (300 s), so that theirs fire first.
SCRIPT_TIMEOUT_S, ONE_HOST_TIMEOUT_S = 900, 300


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + ONE_HOST_TIMEOUT_S + 60)
def test_a_lab_over_two_hosts_equals_one_host(tmp_path):
    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    output = tmp_path / "two_hosts.pt"
    with two_hosts() as hosts, ssh_servers(hosts, tmp_path) as ssh:
        a, b = hosts
        script = [sys.executable, str(HERE / "lab_on_host_a.py"), a.address, b.address, str(output), json.dumps(ssh)]
        run = subprocess.run(
            a.argv([*script, str(folder), b.namespace, b.interface]),
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    print(*[line for line in run.stderr.splitlines() if line.startswith("[")], sep="\n")  # where the time went
    results = torch.load(output, weights_only=False)
    ranks = results["ranks"]
    assert [(r["host"], r["local_rank"]) for r in ranks] == [(a.name, 0), (a.name, 1), (b.name, 0), (b.name, 1)]
    assert a.name in results["table"] and b.name in results["table"]
    assert {r["master"].rsplit(":", 1)[0] for r in ranks} == {a.address}  # A's address as B reaches it
    assert [r["interface"] for r in ranks] == [a.interface, a.interface, b.interface, b.interface]
    started = time.monotonic()
    alone = run_on_ranks(_one_host, 4, folder, timeout_s=ONE_HOST_TIMEOUT_S)
    print(f"one host, 4 ranks: {time.monotonic() - started:.1f} s")
    for config in CONFIGS:
        name, run = config.short(), results["runs"][config.short()]
        roles = [row["role"] for row in run["ranks"]]
        if config.cfg > 1:  # each Ulysses pair (one cfg branch) within a host, where the fast links are
            assert [role.split("·")[0] for role in roles] == ["cfg=0", "cfg=0", "cfg=1", "cfg=1"], roles
        if config.pipefusion > 1:  # one stage per host
            assert [role.split("·")[0] for role in roles] == ["pipefusion=0"] * 2 + ["pipefusion=1"] * 2, roles
        target = alone[0][name]["latents"]
        assert (run["latents"] - target).abs().max().item() <= 1e-4 * max(1.0, target.abs().max().item()), name
        for rank, comm in enumerate(run["comm"]):
            measured = [{g: n for g, n in step.items() if n} for step in comm["measured"]]
            assert measured == alone[rank][name]["moved"], (name, rank)  # the same bytes as on one host
            expected = [{g: n for g, n in step.items() if n} for step in comm["expected"]]
            assert measured == expected and all(measured), (name, rank)
    # host B lost mid-session (its link down, then its engines killed): each time the call fails naming B's ranks and
    # host within the Lab's timeout; once B is back, lab.restart() brings fresh engines on both hosts and the same
    # latents
    target = alone[0][CONFIGS[0].short()]["latents"]
    assert list(results["faults"]) == ["link down", "engines killed"]
    for how, fault in results["faults"].items():
        assert fault["error"] and re.search(rf"ranks? [^\n]*\b{b.name}\b", fault["error"]), (how, fault["error"])
        assert fault["seconds"] <= FAULT_TIMEOUT_S + 15, (how, fault["seconds"])
        assert [r["host"] for r in fault["ranks"]] == [a.name, a.name, b.name, b.name], how
        assert (fault["latents"] - target).abs().max().item() <= 1e-4 * max(1.0, target.abs().max().item()), how
