"""xdit_lab.lessons.tables: the tables and measurements tutorials 05-07 print, from real 2-rank runs of the
digits model (one step each), and the accuracy figures on known tensors."""

import copy

import pytest
import torch

from xdit_lab import ParallelConfig, load_pipeline
from xdit_lab.lab import engine
from xdit_lab.lab.measure import comm_rows, comm_table, compare_to_serial, significant
from xdit_lab.lessons.tables import batch_table, bytes_by_config, quality_row, quality_table, timing_table
from xdit_lab.testing import run_on_ranks

PROMPTS = ["a handwritten 3", "a handwritten 7", "a handwritten 1"]


CASES = {"cfg2": (ParallelConfig(cfg=2), 2.0), "dp2": (ParallelConfig(dp=2), 1.0)}  # dp2 unguided: 3 rows, 2 + 1


def _one_step_each(cases):
    """One step of each (config, guidance) on the same 2 ranks (one spawn for all: the test stays fast)."""
    import torch.distributed as dist

    from xdit_lab.digits import call_kwargs
    from xdit_lab.lab.summaries import rank_summary

    torch.set_num_threads(1)
    out = {}
    for name, (config, guidance_scale) in cases.items():
        pipe = load_pipeline("digits", config, progress=False)
        session = pipe.session(PROMPTS, seed=0, **call_kwargs(num_inference_steps=2, guidance_scale=guidance_scale))
        session.step()
        out[name] = dict(
            summary=rank_summary(session), timings=engine.timings(dict(rank=dist.get_rank(), session=session))
        )
    return out


@pytest.fixture(scope="module")
def runs():
    per_rank = run_on_ranks(_one_step_each, 2, CASES, timeout_s=120)
    return {name: [answer[name] for answer in per_rank] for name in CASES}


def _summaries(runs, name):
    return [out["summary"] for out in runs[name]]


def test_batch_table_names_each_ranks_rows_and_branch(runs):
    cfg = batch_table(_summaries(runs, "cfg2"), PROMPTS)
    assert "rank 0 (cfg 0): rows 0–2 of 6" in cfg and "rank 1 (cfg 1): rows 3–5 of 6" in cfg
    assert "3:cond 'a handwritten 3'" in cfg and "0:uncond 'a handwritten 3'" in cfg
    dp = batch_table(_summaries(runs, "dp2"), PROMPTS)  # no guidance: one row per prompt, split 2 + 1
    assert "rank 0 (dp 0): rows 0–1 of 3" in dp and "rank 1 (dp 1): rows 2 of 3" in dp
    assert "2:prompt 'a handwritten 1'" in dp


def test_comm_rows_and_table_agree_with_the_summaries(runs):
    for name, group in (("cfg2", "cfg"), ("dp2", "dp")):
        summaries = _summaries(runs, name)
        rows = comm_rows(summaries)
        assert [(r["rank"], r["group"]) for r in rows] == [(0, group), (1, group)]
        for r, s in zip(rows, summaries):
            assert r["measured"] == s["comm"]["measured"][-1][group] == r["formula"] > 0
        table = comm_table(summaries)
        assert table.splitlines()[0].split() == ["rank", "role", "group", "measured", "B", "formula", "B", "equal"]
        assert table.count("True") == 2 and f"{rows[0]['measured']:,}" in table
        wrong = copy.deepcopy(summaries[0])
        wrong["comm"]["expected"][-1][group] += 1
        assert "False" in comm_table([wrong])
    # the dp gather pads rank 1's single row to rank 0's two: both send two rows' bytes
    dp_rows = comm_rows(_summaries(runs, "dp2"))
    assert dp_rows[0]["measured"] == dp_rows[1]["measured"] == 2 * 4 * 16 * 16 * 4


def test_bytes_by_config_one_row_per_rank_with_parameters(runs):
    table = bytes_by_config({name: _summaries(runs, name) for name in ("cfg2", "dp2")})
    lines = table.splitlines()
    assert lines[0].split() == [
        "config",
        "rank",
        "role",
        "dp",
        "cfg",
        "pipefusion",
        "ring",
        "ulysses",
        "sp",
        "total",
        "B",
        "params",
        "B",
    ]
    assert len(lines) == 5 and "≠" not in table
    params = _summaries(runs, "cfg2")[0]["memory"]["parameter_bytes"]["transformer"]
    assert all(line.endswith(f"{params:,}") for line in lines[1:])
    assert comm_table([]) == "no bytes moved in this step"


def test_rank_timings_and_table(runs):
    timings = {rank: out["timings"] for rank, out in enumerate(runs["cfg2"])}
    assert list(timings) == [0, 1]
    assert all(len(t["steps"]) == 1 and t["denoise"] > 0 and t["steps"][0] == t["denoise"] for t in timings.values())
    assert engine.timings(dict(rank=1, session=None)) is None
    lines = timing_table({"cfg2": {**timings, 2: None}}).splitlines()
    assert lines[0].split() == ["config", "rank", "denoise", "s", "ms/step"] and len(lines) == 3
    assert lines[1].split()[3] == f"{1000 * timings[0]['denoise']:.1f}"  # one step: ms/step is the denoise time


def test_compare_to_serial_and_quality_rows():
    serial = torch.tensor([[3.0, -4.0], [0.0, 0.0]])
    parallel = serial + torch.tensor([[0.0, 0.5], [0.0, 0.0]])
    figures = compare_to_serial(parallel, serial)
    assert figures["max_relative"] == pytest.approx(0.5 / 4) and figures["relative_l2"] == pytest.approx(0.5 / 5)
    with pytest.raises(ValueError, match="differ in shape"):
        compare_to_serial(serial, serial[0])
    assert significant(0.031249) == "3.1e-02" and significant(1234.0, 3) == "1.23e+03"
    same = quality_row("serial", serial, serial, [1, 2, 3, 4], [1, 2, 3, 5])
    assert same == dict(name="serial", accuracy_pct=75, relative_l2="0", images=4)
    off = quality_row("pf", parallel, serial, [1], [1])
    assert off["relative_l2"] == "1.0e-01" and off["accuracy_pct"] == 100
    with pytest.raises(ValueError, match="readings"):
        quality_row("x", serial, serial, [1, 2], [1])
    table = quality_table([same, off]).splitlines()
    assert table[0].split()[:3] == ["configuration", "images", "accuracy"] and table[2].split() == [
        "pf",
        "1",
        "100",
        "1.0e-01",
    ]


def test_the_price_of_stale_kv_is_drawn_as_the_table_prints_it():
    """06's figure: one line per patch count over the warmup steps, each point the row's own
    relative L2 and accuracy (not recomputed), the serial accuracy as a reference, legible."""
    from xdit_lab.lab.views import legibility_problems
    from xdit_lab.lessons.tables import draw_stale_price

    serial = torch.ones(4, 4)
    rows = [quality_row("serial", serial, serial, [1, 2], [1, 2])]
    for warmup in (0, 1, 2):
        for patches in (2, 4):
            latents = serial + 0.01 * patches / (warmup + 1)
            rows.append(
                quality_row(f"warmup {warmup}, {patches} patches", latents, serial, [1, 2 if warmup else 3], [1, 2])
            )
    fig = draw_stale_price(rows)
    l2_axis, accuracy_axis = fig.axes
    l2_lines = {line.get_label(): list(line.get_ydata()) for line in l2_axis.get_lines()}
    assert l2_lines == {
        f"{p} patches": [pytest.approx(0.01 * p / (w + 1), rel=0.05) for w in (0, 1, 2)] for p in (2, 4)
    }
    accuracy = {line.get_label(): list(line.get_ydata()) for line in accuracy_axis.get_lines()}
    assert accuracy["2 patches"] == accuracy["4 patches"] == [50, 100, 100] and accuracy["serial"] == [100, 100]
    assert not legibility_problems(fig), legibility_problems(fig)


# ---- tensor parallelism's part of tutorial 07 (xdit_lab.lessons.tensor) ------------------------------------------


def test_tp_block_shards_are_the_whole_weight_s_slices_and_its_bytes_the_closed_form():
    """On 2 ranks and 3 (the third idle under tp 2): rank r's q holds rows [r·n/2, (r+1)·n/2) of the whole q and its
    output projection those columns; the block's collectives are its four rowwise all-reduces and its two
    modulations' all-gathers, each with the closed form's bytes, and the forward's tp bytes are
    traffic.tp_bytes_per_forward's."""
    from xdit_lab.lessons.tensor import collective_table, shard_table, tp_block

    results = dict(enumerate(run_on_ranks(tp_block, 3, {}, ParallelConfig(tp=2), timeout_s=240)))
    assert results[2] is None
    for rank in (0, 1):
        r = results[rank]
        shards = {s["layer"]: s for s in r["shards"]}
        q, out = shards["attn.to_q"], shards["attn.to_out.0"]
        assert (q["dim"], q["start"], q["stop"]) == ("out (rows)", rank * q["of"] // 2, (rank + 1) * q["of"] // 2)
        assert (out["dim"], out["start"], out["stop"]) == (
            "in (columns)",
            rank * out["of"] // 2,
            (rank + 1) * out["of"] // 2,
        )
        assert all(s["exact"] for s in r["shards"]), r["shards"]
        assert q["held"] == [q["whole"][0] // 2, q["whole"][1]] and out["held"] == [
            out["whole"][0],
            out["whole"][1] // 2,
        ]
        ops = [(c["op"], c["layer"]) for c in r["collectives"]]
        assert sorted(ops) == sorted(
            [("all_reduce", name) for name in ("attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2")]
            + [("all_gather", name) for name in ("norm1.linear", "norm1_context.linear")]
        ), ops
        assert all(c["bytes_out"] == c["formula"] > 0 for c in r["collectives"]), r["collectives"]
        assert r["forward_tp_bytes"] == r["forward_formula"] > 0
        assert r["held_bytes"] < 0.6 * r["whole_bytes"]
    assert "NO" not in shard_table(results) and "all_reduce" in collective_table(results, 1)


def test_bytes_by_config_shows_tp_where_a_run_splits_over_it_and_a_disagreement_with_the_formula():
    from xdit_lab.lessons.tables import bytes_by_config

    def summary(rank, config, measured, expected, params):
        coords = {name: 0 for name in ("dp", "cfg", "pipefusion", "ring", "ulysses", "tp")} | {next(iter(config)): rank}
        return dict(
            rank=rank,
            coords=coords,
            config={"dp": 1, "cfg": 1, "pipefusion": 1, "ring": 1, "ulysses": 1, "tp": 1} | config,
            comm=dict(measured=[measured], expected=[expected]),
            memory=dict(parameter_bytes=dict(transformer=params)),
        )

    runs = {
        "tp2": [summary(1, {"tp": 2}, {"tp": 100}, {"tp": 100}, 50), None],
        "ulysses2": [summary(1, {"ulysses": 2}, {"ulysses": 30, "sp": 4}, {"ulysses": 31, "sp": 4}, 90)],
    }
    header, tp_row, ulysses_row = bytes_by_config(runs).splitlines()  # the idle rank (None) has no row
    assert header.split()[3:10] == ["dp", "cfg", "pipefusion", "ring", "ulysses", "tp", "sp"]
    assert tp_row.split() == ["tp2", "1", "tp", "1", "-", "-", "-", "-", "-", "100", "-", "100", "50"]
    assert ulysses_row.split()[-5:] == ["30≠31", "-", "4", "34", "90"]
    # without a tp run, the five degrees' table reads as before: no tp column
    assert "tp" not in bytes_by_config({"ulysses2": runs["ulysses2"]}).splitlines()[0].split()
