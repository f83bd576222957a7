"""The token strategy's interface (#56 point 4, models/strategy.py): both strategies carry every member
TokenStrategy declares (the hooks read them, no getattr default stands in for a missing one), answer the
views through one report() with a frozen StrategyReport, and keep no view method beside it. A step is
handed a StepContext, which is frozen too."""

import dataclasses

import pytest
import torch

from xdit_lab import ParallelConfig, parallelize
from xdit_lab.models import StepContext, StrategyReport, TokenStrategy, parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

MEMBERS = [name for name in vars(TokenStrategy) if not name.startswith("_")] + list(TokenStrategy.__annotations__)
VIEWS_BEFORE = ("token_pieces", "staleness", "kept_bytes")  # what the views asked before report()


def _strategies():
    """On this rank: per strategy, the members of TokenStrategy it lacks, the view methods it still has,
    and its report before and after a forward, for the forward's grid of tokens and its 2 batch rows."""
    rows, inputs = {}, tiny_inputs("pixart", 2)
    for degrees in (dict(ulysses=2), dict(pipefusion=2)):
        model = parallelize(tiny_transformer("pixart", seed=0), ParallelConfig(**degrees))
        patch = model.config.patch_size
        grid = tuple(side // patch for side in inputs["hidden_states"].shape[-2:])
        strategy = parallel_state(model).strategy
        before = strategy.report(grid=grid, rows=2)
        with torch.no_grad():
            model(**inputs)
        rows[type(strategy).__name__] = dict(
            missing=[name for name in MEMBERS if not hasattr(strategy, name)],
            views=[name for name in VIEWS_BEFORE if hasattr(strategy, name)],
            before=before,
            after=strategy.report(grid=grid, rows=2),
        )
    return rows


def test_both_strategies_declare_the_interface_and_report_in_one_record():
    assert {"shard", "attend", "gather", "splits_tokens", "text_shard_at", "run_step", "report"} <= set(MEMBERS)
    for rows in run_on_ranks(_strategies, 2, timeout_s=120):
        assert set(rows) == {"SequenceShards", "PipeFusionStage"}
        for name, row in rows.items():
            assert row["missing"] == [] and row["views"] == [], (name, row["missing"], row["views"])
            assert isinstance(row["after"], StrategyReport)
            with pytest.raises(dataclasses.FrozenInstanceError):
                row["after"].step = 0
        shards, stage = rows["SequenceShards"], rows["PipeFusionStage"]
        assert shards["after"].kept_bytes == {} and shards["after"].planned_kept_bytes == {}
        assert shards["after"].tokens["source"] == "SequenceShards.shard_range"
        # the stage: nothing held before a step, its stale K/V after one, as planned for the forward's rows and grid
        assert stage["before"].kept_bytes == {"stale K/V": 0} and stage["before"].step == 0
        assert stage["after"].step == 1 and stage["after"].tokens["source"] == "PatchLayout"
        assert stage["after"].kept_bytes["stale K/V"] > 0
        assert stage["after"].kept_bytes == stage["after"].planned_kept_bytes


def test_a_step_context_is_frozen():
    context = StepContext(pipeline=None, prepared=None, recipe=None, step_index=3, num_steps=4)
    assert context.last and not dataclasses.replace(context, step_index=2).last
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.step_index = 0
