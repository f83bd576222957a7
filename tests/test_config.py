"""ParallelConfig: every validation rule and its message, options() against brute force, the cost model
against the published table (recomputed here from the formulas, not from config.py)."""

import itertools
import math

import pytest

from xdit_lab import CostEstimate, ParallelConfig, ParallelConfigError


def _message(config, *args, **kwargs) -> str:
    with pytest.raises(ParallelConfigError) as caught:
        config.validate(*args, **kwargs)
    return str(caught.value)


# ---- validate(): one rule at a time ------------------------------------------------------------


def test_error_is_a_value_error_and_valid_config_returns_itself():
    assert issubclass(ParallelConfigError, ValueError)
    config = ParallelConfig(cfg=2, ulysses=2)
    assert config.validate(4, num_heads=4, num_layers=2, seq_len=64) is config
    assert config.validate() is config  # no world size: only the rules of the degrees themselves
    with pytest.raises(ValueError):
        ParallelConfig(ring=0).validate()


def test_product_not_world_size_spells_the_product():
    text = _message(ParallelConfig(cfg=2, ulysses=2), 8, available_devices=8)
    assert "cfg 2 × ulysses 2 = 4 ranks, but the world size is 8" in text
    assert "ParallelConfig(dp=1, cfg=2, pipefusion=1, ring=1, ulysses=2" in text


def test_any_head_count_runs_under_ulysses_with_a_head_for_every_rank():
    """6 heads under ulysses 4 run (2 + 2 + 1 + 1: attention/ulysses.py); 3 heads cannot give 4 ranks one each."""
    ParallelConfig(ulysses=4).validate(4, num_heads=6)
    ParallelConfig(ulysses=4, ring=2).validate(8, num_heads=30)
    text = _message(ParallelConfig(ulysses=4), 4, num_heads=3)
    assert "3 attention heads cannot give each of ulysses 4 ranks a head; use ulysses <= 3" in text
    assert "ulysses4" in [c.short() for c in ParallelConfig.options(4, num_heads=30, use_cfg=False)]
    assert "ulysses4" not in [c.short() for c in ParallelConfig.options(4, num_heads=3, use_cfg=False)]


def test_fewer_layers_than_pipefusion_stages():
    text = _message(ParallelConfig(pipefusion=4), 4, num_layers=3)
    assert "3 transformer layers cannot fill 4 PipeFusion stages; use pipefusion <= 3" in text
    ParallelConfig(pipefusion=4).validate(4, num_layers=4)  # exactly one layer per stage is fine


def test_num_patches_below_stage_count():
    text = _message(ParallelConfig(pipefusion=4, num_patches=3), 4)
    assert "num_patches 3 is below the 4 PipeFusion stages" in text
    ParallelConfig(pipefusion=4, num_patches=4).validate(4)
    ParallelConfig(pipefusion=4, num_patches=8).validate(4)


def test_seq_len_too_short_for_patches_times_sp():
    text = _message(ParallelConfig(pipefusion=2, ulysses=2), 4, seq_len=3)
    assert "3 image tokens cannot give each of 2 patch(es) × 2 sequence-parallel ranks a token" in text
    ParallelConfig(pipefusion=2, ulysses=2).validate(4, seq_len=4)


@pytest.mark.parametrize("name", ["dp", "cfg", "pipefusion", "ring", "ulysses"])
def test_degree_below_one(name):
    text = _message(ParallelConfig(**{name: 0}))
    assert f"every degree must be at least 1, got {name}=0" in text


@pytest.mark.parametrize("cfg", [3, 4])
def test_cfg_outside_one_or_two(cfg):
    text = _message(ParallelConfig(cfg=cfg), cfg)
    assert f"cfg must be 1 or 2 (the unconditional and conditional branch), got {cfg}" in text


def test_negative_warmup_and_non_int_degrees():
    assert "warmup_steps must be 0 or more, got -1" in _message(ParallelConfig(warmup_steps=-1))
    with pytest.raises(ParallelConfigError, match=r"ulysses must be an int, got 2.0"):
        ParallelConfig(ulysses=2.0)
    with pytest.raises(ParallelConfigError, match=r"ring must be an int, got True"):
        ParallelConfig(ring=True)


def test_several_violations_in_one_message():
    config = ParallelConfig(cfg=2, pipefusion=4, num_patches=2, ulysses=4)
    text = _message(config, 8, num_heads=3, num_layers=2)
    bullets = [line for line in text.splitlines() if line.startswith("  - ")]
    assert len(bullets) == 4, text
    for part in (
        "num_patches 2 is below",
        "cannot give each of ulysses 4 ranks a head",
        "cannot fill 4 PipeFusion stages",
        "cfg 2 × pipefusion 4 × ulysses 4 = 32 ranks, but the world size is 8",
    ):
        assert part in text


# ---- world-size advice -------------------------------------------------------------------------------


def test_xdit_case_cfg2_ulysses2_on_two_of_four_devices():
    text = _message(ParallelConfig(cfg=2, ulysses=2), 2, available_devices=4)
    assert "cfg 2 × ulysses 2 = 4 ranks, but the world size is 2" in text
    fits = ", ".join(c.short() for c in ParallelConfig.options(2))
    assert f"Configurations that fit 2 ranks (best first): {fits}, or run on 2 of your 4 devices." in text
    assert {"cfg2", "ulysses2", "ring2", "pf2", "dp2"} <= set(fits.split(", "))
    assert "launch 4 ranks: you have 4 devices (torchrun --nproc_per_node 4)" in text


def test_config_smaller_than_world_may_run_on_a_subset():
    text = _message(ParallelConfig(ulysses=2), 4, available_devices=4)
    assert "ulysses 2 = 2 ranks, but the world size is 4" in text
    assert "may run on a subset" in text and "can run on 2 of your 4 ranks" in text


def test_no_spare_devices_suggests_torchrun_only():
    text = _message(ParallelConfig(cfg=2, ulysses=2), 2, available_devices=2)
    assert "of your" not in text  # no "run on 2 of your 2 devices"
    assert "Or keep this configuration on 4 ranks (torchrun --nproc_per_node 4)." in text


# ---- options(): complete, valid, ranked ----------------------------------------------------------------


def _brute_force(world_size, num_heads, num_layers, seq_len, use_cfg):
    """All five degrees from 1 to N, kept when they obey every rule (num_patches = one per stage)."""
    found = set()
    for dp, cfg, pf, ring, uly in itertools.product(range(1, world_size + 1), repeat=5):
        if dp * cfg * pf * ring * uly != world_size or cfg not in ((1, 2) if use_cfg else (1,)):
            continue
        if num_heads is not None and num_heads < uly:
            continue
        if num_layers is not None and num_layers < pf:
            continue
        if seq_len is not None and seq_len < pf * ring * uly:
            continue
        found.add((dp, cfg, pf, ring, uly))
    return found


SHAPES = [
    dict(num_heads=None, num_layers=None, seq_len=None),
    dict(num_heads=4, num_layers=2, seq_len=None),
    dict(num_heads=6, num_layers=28, seq_len=16),
    dict(num_heads=3, num_layers=1, seq_len=2),
]


def _cost_key(config, num_layers, batch, use_cfg, num_heads):
    """The documented order: work, then communication, then parameters, then fewest parallel dimensions."""
    cost = config.cost(num_layers, num_heads=num_heads, batch=batch, use_cfg=use_cfg)
    dims = sum(d > 1 for d in (config.dp, config.cfg, config.pipefusion, config.ring, config.ulysses))
    return (round(cost.work_fraction, 9), round(cost.comm_p_hs, 9), cost.params_fraction, dims)


@pytest.mark.parametrize("use_cfg", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{num_heads}-l{num_layers}-s{seq_len}".format(**s))
def test_options_complete_valid_and_ranked(shape, use_cfg):
    for world_size in range(1, 9):
        for batch in (1, 3):
            options = ParallelConfig.options(world_size, use_cfg=use_cfg, batch=batch, **shape)
            got = [(c.dp, c.cfg, c.pipefusion, c.ring, c.ulysses) for c in options]
            assert len(got) == len(set(got)), "duplicates"
            assert set(got) == _brute_force(world_size, use_cfg=use_cfg, **shape), (world_size, shape)
            for c in options:
                assert c.validate(world_size, **shape) is c
            keys = [_cost_key(c, shape["num_layers"], batch, use_cfg, shape["num_heads"]) for c in options]
            assert keys == sorted(keys), (world_size, shape, [c.short() for c in options])
            if not use_cfg:
                assert all(c.cfg == 1 for c in options)


def test_options_rejects_bad_world_size_and_keeps_num_patches_legal():
    for bad in (0, -2, 2.0, "4"):
        with pytest.raises(ParallelConfigError, match="world_size must be a positive int"):
            ParallelConfig.options(bad)
    for c in ParallelConfig.options(8, num_patches=2):
        assert c.patches == max(2, c.pipefusion)
    # with cfg available, the best 2-rank plan for one prompt splits the two CFG branches
    assert ParallelConfig.options(2)[0].short() == "cfg2"
    assert ParallelConfig.options(2, use_cfg=False)[0].short() != "cfg2"


# ---- cost model: the elements a rank sends (tests/test_cost_model.py measures them on real ranks) --------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("layers", [1, 28])
def test_cost_single_method_counts_what_a_rank_sends(n, layers):
    def per_branch(config):  # one prompt without guidance: exactly one image branch per rank
        return config.cost(layers, use_cfg=False)

    ulysses = per_branch(ParallelConfig(ulysses=n))
    assert math.isclose(ulysses.comm_p_hs, 4 * (n - 1) / n**2 * layers)  # keeps 1/N of each of q, k, v, out
    ring = per_branch(ParallelConfig(ring=n))
    assert math.isclose(ring.comm_p_hs, 2 * (n - 1) / n * layers)
    pipe = per_branch(ParallelConfig(pipefusion=n))
    assert math.isclose(pipe.comm_p_hs, 2) and math.isclose(pipe.params_fraction, 1 / n)
    for single in (ulysses, ring, pipe):
        assert math.isclose(single.work_fraction, 1 / n)
    assert ulysses.params_fraction == ring.params_fraction == 1.0
    # with guidance and no cfg parallelism each rank carries both branches: everything doubles
    both = ParallelConfig(ulysses=n).cost(layers, use_cfg=True)
    assert math.isclose(both.comm_p_hs, 2 * 4 * (n - 1) / n**2 * layers) and math.isclose(both.work_fraction, 2 / n)


def test_cost_cfg_dp_and_hybrid():
    cfg2 = ParallelConfig(cfg=2).cost(28)
    assert (cfg2.work_fraction, cfg2.comm_p_hs, cfg2.params_fraction) == (1.0, 0.0, 1.0)
    # dp splits prompts, not an image: one prompt gains nothing, four prompts on dp 4 are one each
    assert ParallelConfig(dp=4).cost(28, batch=1, use_cfg=False).work_fraction == 1.0
    assert ParallelConfig(dp=4).cost(28, batch=4, use_cfg=False).work_fraction == 1.0
    assert ParallelConfig(dp=4).cost(28, batch=5, use_cfg=False).work_fraction == 2.0  # ceil(5/4)
    # hybrid: Ulysses on the ring's half of the tokens, Ring on Ulysses' half of the heads, L/2 layers per stage
    hybrid = ParallelConfig(ulysses=2, ring=2, pipefusion=2).cost(8, use_cfg=False)
    expected = 4 * (1 / 4) * (1 / 2) * (8 / 2) + 2 * (1 / 2) * (1 / 2) * (8 / 2) + 2 / (2 * 2)
    assert math.isclose(hybrid.comm_p_hs, expected)
    assert math.isclose(hybrid.work_fraction, 1 / 8) and hybrid.params_fraction == 0.5


def test_cost_of_heads_the_ulysses_degree_does_not_divide():
    """3 heads under ulysses 2 are 2 + 1: the rank with one head sends q, k, v of two and o of one,
    (3·2 + 1)/(2·3) of p·hs per layer, the busiest. 30 heads under ulysses 4 (8, 8, 7, 7): every rank sends
    (3·(30 - H_r) + 3·H_r)/(4·30) = 3/4, as an even split does. Ring passes K/V of the rank's heads: 5 heads
    under ulysses 2 × ring 2, the rank with 2 of them sends (3·3 + 2)/(2·5)/2 + 2·(1/2)·(2/5), the one with 3
    (3·2 + 3)/(2·5)/2 + 2·(1/2)·(3/5), more: the busiest counts. Work (tokens per rank) is unchanged."""
    one_branch = dict(batch=1, use_cfg=False)
    assert math.isclose(ParallelConfig(ulysses=2).cost(1, num_heads=3, **one_branch).comm_p_hs, 7 / 6)
    assert math.isclose(ParallelConfig(ulysses=2).cost(1, **one_branch).comm_p_hs, 1.0)  # as if they divided
    assert math.isclose(ParallelConfig(ulysses=4).cost(1, num_heads=30, **one_branch).comm_p_hs, 3 / 4)
    usp = ParallelConfig(ulysses=2, ring=2).cost(1, num_heads=5, **one_branch).comm_p_hs
    assert math.isclose(usp, max(11 / 20 + 2 / 5, 9 / 20 + 3 / 5))
    assert ParallelConfig(ulysses=2).cost(1, num_heads=3, **one_branch).work_fraction == 0.5


def test_comm_bytes():
    estimate = CostEstimate(work_fraction=0.5, comm_p_hs=3.0, params_fraction=1.0)
    assert estimate.comm_bytes(4096, 1152) == 3 * 4096 * 1152 * 2
    assert estimate.comm_bytes(10, 10, dtype_bytes=4) == 1200


def test_ranking_reasons_name_the_figure_that_decides():
    """Each reason names the first cost-model figure in which a configuration beats the next one; the
    figures below are worked out by hand from the table in config.py (2 layers, 2 prompts with guidance:
    4 rows, so dp2·cfg2 and dp4 each carry one)."""
    from xdit_lab.config import ranking_reasons

    ranked = [
        ParallelConfig(dp=4, pipefusion=2),  # work 1/2, traffic 1 row × 2/1 = 2, weights 1/2, 2 degrees
        ParallelConfig(dp=2, cfg=2, pipefusion=2),  # the same, 3 degrees
        ParallelConfig(dp=4, ring=2),  # work 1/2, traffic 2 × 1/2 × 2 layers = 2, weights 1, 2 degrees
        ParallelConfig(dp=2, cfg=2, ring=2),  # the same, 3 degrees
        ParallelConfig(cfg=2, pipefusion=2, ring=2),  # 2 rows: work 1/2, traffic 2 × (2/2 + 2 × 1/2 × 1) = 4
        ParallelConfig(dp=2, pipefusion=2, ring=2),  # the same figures and degrees; less dp is preferred
        ParallelConfig(dp=8),  # work 1
    ]
    assert ranked == [c for c in ParallelConfig.options(8, num_layers=2, batch=2) if c in ranked]
    assert ranking_reasons(ranked, 2, batch=2) == [
        "the same cost as dp2·cfg2·pf2, fewer degrees above 1 (simpler to run)",
        "the same compute and traffic as dp4·ring2, fewer weights per rank",
        "the same cost as dp2·cfg2·ring2, fewer degrees above 1 (simpler to run)",
        "as much compute, less traffic per rank than cfg2·pf2·ring2",
        "ties with dp2·pf2·ring2: less dp (preferred last)",
        "less compute per rank than dp8",
        "",
    ]
