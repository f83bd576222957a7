"""xdit-lab demo and the bundled model's quality under the exact strategies."""

import json

import pytest

from xdit_lab import ParallelConfig
from xdit_lab.demo import default_config, run_demo


def test_default_strategy_is_exact_and_fits():
    for ranks in (1, 2, 4):
        config = default_config(ranks)
        assert config.world_size == ranks and config.pipefusion == 1


@pytest.mark.parametrize(
    "config",
    [ParallelConfig(cfg=2), ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2)],
    ids=lambda c: c.short(),
)
def test_demo_draws_the_ten_digits(config, tmp_path):
    """The ten digits under each exact strategy: the classifier reads at least 9 of them (the
    model card measures 100 images per strategy; benchmarks/digits_quality.py prints them)."""
    report = run_demo(config, 2, tmp_path, seed=0)
    assert (tmp_path / "digits_grid.png").is_file()
    assert json.loads((tmp_path / "report.json").read_text())["config_short"] == config.short()
    assert len(report["ranks"]) == 2 and report["accuracy"] >= 0.9
    group = next(g for g in ("cfg", "ulysses", "ring", "dp") if getattr(config, g) > 1)
    assert all(r["bytes_out_by_group"].get(group, 0) > 0 for r in report["ranks"])
