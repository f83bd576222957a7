"""The Lab's CPU engines are forks of one process that imported the libraries once (xdit_lab/lab/forkserver.py):
what a forked engine starts with equals what ipyparallel's own launcher gives a fresh one, apart from the imports
already done. (That they end with the process that made the Lab: tests/test_lab.py; that their images equal
diffusers': every Lab test, as forks are the CPU default.)"""

import os

import ipyparallel as ipp
import pytest

from xdit_lab.lab import Lab

PROBE = {"XDIT_LAB_PROBE": "forked or not"}


@ipp.interactive  # sent by value: the engines cannot import this test module
def who_am_i() -> dict:
    """On an engine, before anything is loaded: its environment, folder, threads, imports, random draws."""
    import os
    import random
    import sys

    import numpy

    return dict(
        # (the Lab's torch.distributed set MASTER_PORT, a free port of each Lab; IPP_*: each cluster's own)
        env={k: v for k, v in os.environ.items() if not k.startswith("IPP_") and k != "MASTER_PORT"},
        cwd=os.getcwd(),
        session_leader=os.getsid(0) == os.getpid(),
        diffusers_imported="diffusers.pipelines.pipeline_utils" in sys.modules,
        draws=(random.random(), float(numpy.random.rand())),
        parent=os.getppid(),
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))  # not the user's ~/.ipython
        for fork in (True, False):
            with Lab(n=2, fork_engines=fork, engine_env=PROBE, timeout_s=120) as lab:
                found[fork] = lab.call(who_am_i, state=False, what="who am i")
    return found


def test_a_forked_engine_starts_as_a_spawned_one_does(engines):
    forked, spawned = engines[True], engines[False]
    for rank in (0, 1):
        assert forked[rank]["env"] == spawned[rank]["env"]  # os.environ + the Lab's engine environment, exactly
        assert forked[rank]["env"]["XDIT_LAB_PROBE"] == PROBE["XDIT_LAB_PROBE"]
        assert forked[rank]["env"]["OMP_NUM_THREADS"] == "1"  # CPU engines: one thread each
        assert forked[rank]["cwd"] == spawned[rank]["cwd"]
        assert forked[rank]["session_leader"] and spawned[rank]["session_leader"]  # a notebook's interrupt skips them


def test_a_forked_engine_has_the_imports_done_and_a_random_state_of_its_own(engines):
    forked, spawned = engines[True], engines[False]
    assert all(forked[rank]["diffusers_imported"] for rank in (0, 1))
    assert not any(spawned[rank]["diffusers_imported"] for rank in (0, 1))  # control: a fresh one has not
    assert forked[0]["parent"] == forked[1]["parent"] != os.getpid()  # both forks of one server
    assert forked[0]["draws"][0] != forked[1]["draws"][0]  # Python's random, reseeded in each fork
    assert forked[0]["draws"][1] != forked[1]["draws"][1]  # numpy's too
