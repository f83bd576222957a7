"""RankMesh on real gloo ranks: coordinates, groups (checked by all-reducing rank ids), neighbours."""

import pytest
import torch

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, comm, comm_log
from xdit_lab.config import GRID
from xdit_lab.mesh import GROUP_NAMES
from xdit_lab.testing import RankFailure, run_on_ranks


def _group_sums(config):
    mesh = RankMesh(config)
    out = {"str": str(mesh), "coords": mesh.coords, "prev": mesh.pipeline_prev, "next": mesh.pipeline_next}
    with comm_log() as log:
        for name in GROUP_NAMES:
            rank_id = torch.tensor([float(mesh.rank)])
            comm.all_reduce(rank_id, mesh, name)
            out[name] = (int(rank_id.item()), mesh.group_ranks(name))
    out["groups_logged"] = sorted({r.group for r in log})
    return out


def _expected_members(config, rank, name):
    """Brute force: ranks whose coordinates equal this rank's in every dimension outside the group."""
    varying = {
        "sp": ("ring", "ulysses"),
        "image": ("pipefusion", "ring", "ulysses"),
        "world": GRID,
        "weights": ("dp", "cfg", "ring", "ulysses"),  # the ranks that hold the same weights: one stage's
    }.get(name, (name,))
    sizes = [getattr(config, d) for d in GRID]

    def coords(r):
        c = {}
        for d, size in zip(reversed(GRID), reversed(sizes)):
            r, c[d] = divmod(r, size)
        return c

    mine = coords(rank)
    return [r for r in range(config.world_size) if all(coords(r)[d] == mine[d] for d in GRID if d not in varying)]


@pytest.mark.parametrize(
    "config",
    [
        ParallelConfig(ulysses=2, ring=2),
        ParallelConfig(cfg=2, ulysses=2),
        ParallelConfig(dp=2, pipefusion=2),
        ParallelConfig(pipefusion=2, ulysses=2),
        ParallelConfig(ulysses=2, ring=2, cfg=2),
        ParallelConfig(ulysses=2, tp=2),  # tp varies fastest: its pairs are neighbours
        ParallelConfig(cfg=2, tp=2),
    ],
    ids=lambda c: c.short(),
)
def test_groups_sum_rank_ids(config):
    results = run_on_ranks(_group_sums, config.world_size, config)
    for rank, out in enumerate(results):
        for name in GROUP_NAMES:
            members = _expected_members(config, rank, name)
            total, ranks = out[name]
            assert ranks == members, (rank, name)
            assert total == sum(members), (rank, name, total, members)
        # each group of size > 1 shows its traffic in the log, under its own name
        assert out["groups_logged"] == sorted(n for n in GROUP_NAMES if len(_expected_members(config, rank, n)) > 1)


def test_rank_order_and_str():
    config = ParallelConfig(dp=1, cfg=2, ulysses=2, ring=2)  # 8 ranks; mesh math needs no processes
    mesh = RankMesh(config, rank=5, world_size=8)
    assert mesh.coords == {"dp": 0, "cfg": 1, "pipefusion": 0, "ring": 0, "ulysses": 1, "tp": 0}
    assert str(mesh) == "dp0 cfg1 pf0 ring0 ulysses1 (rank 5 of 8)"
    assert [RankMesh(config, rank=r, world_size=8).coords["ulysses"] for r in range(8)] == [0, 1] * 4
    assert [RankMesh(config, rank=r, world_size=8).coords["ring"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [RankMesh(config, rank=r, world_size=8).coords["cfg"] for r in range(8)] == [0] * 4 + [1] * 4
    # tp varies fastest, and a grid with tp 1 keeps every rank where it was before tp
    with_tp = config.replace(tp=2)
    assert [RankMesh(with_tp, rank=r, world_size=16).coords["tp"] for r in range(16)] == [0, 1] * 8
    assert str(RankMesh(with_tp, rank=11, world_size=16)) == "dp0 cfg1 pf0 ring0 ulysses1 tp1 (rank 11 of 16)"
    for r in range(16):  # a tp 2 grid is the tp 1 grid with each rank doubled: rank r holds r // 2's coordinates
        coords = RankMesh(with_tp, rank=r, world_size=16).coords
        assert {k: v for k, v in coords.items() if k != "tp"} == {
            k: v for k, v in RankMesh(config, rank=r // 2, world_size=8).coords.items() if k != "tp"
        }


def test_pipeline_neighbours():
    config = ParallelConfig(pipefusion=3, ulysses=2)
    stages = [RankMesh(config, rank=r, world_size=6) for r in range(6)]
    # rank 1 is ulysses 1 of stage 0: its next stage is rank 3 (stage 1, ulysses 1), previous is 5
    assert (stages[1].pipeline_next, stages[1].pipeline_prev) == (3, 5)
    assert stages[4].is_last_stage and stages[0].is_first_stage


def _subset(config):
    mesh = RankMesh(config)
    value = torch.tensor([1.0])
    if mesh.active:
        comm.all_reduce(value, mesh, "ulysses")
    return mesh.active, float(value.item()), str(mesh)


def test_subset_of_ranks_runs_and_rest_idle():
    results = run_on_ranks(_subset, 4, ParallelConfig(ulysses=2))
    assert [active for active, _, _ in results] == [True, True, False, False]
    assert [v for _, v, _ in results] == [2.0, 2.0, 1.0, 1.0]
    assert results[3][2].startswith("idle")


def test_mesh_larger_than_world_names_the_fix():
    with pytest.raises(ParallelConfigError, match=r"cfg 2 × ulysses 2 = 4 ranks, but the world size is 2"):
        RankMesh(ParallelConfig(cfg=2, ulysses=2), rank=0, world_size=2)


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return dist.get_rank()


def test_harness_reraises_child_traceback():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 raised:.*ValueError: boom on rank one"):
        run_on_ranks(_raise_on_rank_one, 2, timeout_s=60)


def _hang_rank_one():
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    return 0


def test_harness_times_out_a_hung_rank():
    with pytest.raises(RankFailure, match=r"rank 1 did not finish within 8 s"):
        run_on_ranks(_hang_rank_one, 2, timeout_s=8)
