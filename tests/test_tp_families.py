"""tp 2 composed on 4 ranks, in every family with a tp plan, against diffusers' serial forward.

Each family's forward under tp2·ulysses2 and tp2·cfg2 (test_tensor_parallel._forward: batch 2, so cfg 2 has a
row a branch) and under tp2·pf2 with every step warmed up (test_pipefusion._steps, exact), each within 1e-4 of
diffusers' serial forward in float32, each step's bytes per group equal to the closed form, tp's and the other
group's both moving. Several families a launch: the ranks start once for all their families and configurations.
Flux's tp2·ring2 and tp2·dp2, and its and SD3's stale tp2·pf2, are in tests/test_tensor_parallel.py and
tests/test_tp_pipefusion.py."""

import pytest
from forward_traffic import traffic_mismatches
from test_pipefusion import STEPS, _steps
from test_tensor_parallel import HEADS, _check, _forward

from xdit_lab import ParallelConfig
from xdit_lab.testing import run_on_ranks

COMPOSED = [ParallelConfig(tp=2, ulysses=2), ParallelConfig(tp=2, cfg=2)]
TP2_PF2 = ParallelConfig(tp=2, pipefusion=2, warmup_steps=STEPS)  # every step warms up: exact
LAUNCHES = [  # every family with a tp plan, a few a launch of 4 ranks
    ("flux", "flux2", "qwenimage", "wan"),
    ("hunyuanvideo", "cogvideox", "sd3", "pixart"),
    ("zimage", "hunyuanvideo15", "dit"),
]


def _compositions(families):
    """Per family: its forward under each of COMPOSED, and its STEPS forwards under TP2_PF2 (HEADS' heads where
    its tiny model's 3 do not split over tp 2)."""
    return {
        family: dict(
            composed=_forward(family, COMPOSED),
            pipefusion=_steps(TP2_PF2, family, heads=HEADS.get(family))["rows"],
        )
        for family in families
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("families", LAUNCHES, ids="-".join)
def test_tp2_with_ulysses2_cfg2_and_pf2_equals_serial_diffusers(families):
    per_rank = run_on_ranks(_compositions, 4, families, timeout_s=540)
    for family in families:
        _check([runs[family]["composed"] for runs in per_rank], family)  # exact, held as planned, bytes as closed
        for rank, runs in enumerate(per_rank):
            for config, row in zip(COMPOSED, runs[family]["composed"]):
                other = "ulysses" if config.ulysses > 1 else "cfg"
                assert {other, "tp"} <= {group for _, group in row["ops"]}, f"{family} {config.short()} rank {rank}"
            where = f"{family} {TP2_PF2.short()} rank {rank}"
            rows = runs[family]["pipefusion"]
            for step, row in enumerate(rows):
                assert row["error"] <= row["bound"], f"{where} step {step}: error {row['error']:.3g}"
                assert {"tp", "pipefusion"} <= set(row["moved"]), f"{where} step {step}: {row['moved']}"
            assert not traffic_mismatches(rows, where), traffic_mismatches(rows, where)
