"""init_distributed: gloo on CPU, a finite timeout, one thread per core share; bad environments fail clearly."""

import json
import math
import os
import subprocess
import sys

from xdit_lab.distributed import usable_cpu_cores
from xdit_lab.testing import run_on_ranks


def _describe_world():
    import torch
    import torch.distributed as dist

    from xdit_lab.distributed import current_info, init_distributed

    info = current_info()
    again = init_distributed()  # a second call in an initialised process returns the same world
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return dict(
        rank=info.rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        backend=info.backend,
        dist_backend=dist.get_backend(),
        device=str(info.device),
        timeout_s=info.timeout_s,
        again=again == info,
        threads=torch.get_num_threads(),
        total=total.item(),
    )


def test_two_gloo_ranks():
    results = run_on_ranks(_describe_world, 2, timeout_s=60, collective_timeout_s=20)
    assert [r["rank"] for r in results] == [0, 1] and [r["local_rank"] for r in results] == [0, 1]
    expected_threads = max(1, usable_cpu_cores() // 2)  # 2 ranks share the cores: 1 each on 2 cores
    for r in results:
        assert r["world_size"] == 2 and r["total"] == 2.0
        assert r["backend"] == r["dist_backend"] == "gloo" and r["device"] == "cpu"
        assert r["timeout_s"] == 20 and math.isfinite(r["timeout_s"])
        assert r["again"]
        assert r["threads"] == expected_threads
        if usable_cpu_cores() == 2:
            assert r["threads"] == 1


_BAD_ENV_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from xdit_lab import init_distributed
outcomes = []
for env in json.loads(sys.argv[1]):
    os.environ.update(env)
    try:
        init_distributed(timeout_s=5)
        outcomes.append(["no error"])
    except Exception as error:
        outcomes.append([type(error).__name__, str(error), dist.is_initialized()])
print(json.dumps(outcomes))
"""
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_bad_environment_gives_clear_value_errors():
    # one fresh interpreter for all cases (so this process never joins a world; torch imports once)
    cases = [dict(RANK="abc", WORLD_SIZE="2"), dict(RANK="3", WORLD_SIZE="2"), dict(RANK="0", WORLD_SIZE="2")]
    clean = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    result = subprocess.run(
        [sys.executable, "-c", _BAD_ENV_SCRIPT, json.dumps(cases)],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    non_int, outside, no_port = json.loads(result.stdout.strip().splitlines()[-1])
    assert non_int == ["ValueError", "environment variable RANK='abc' is not an integer", False]
    assert outside == ["ValueError", "rank 3 is outside a world of 2 ranks", False]
    assert no_port[0] == "ValueError" and "MASTER_PORT is not set" in no_port[1] and no_port[2] is False
