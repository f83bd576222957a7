"""FP8 on the wire (ParallelConfig.comm_dtype): Ulysses' all-to-alls and Ring's K/V blocks carry float8
with a float32 scale per token and head (xdit_lab/attention/wire.py).

An approximation, measured: each family's tiny transformer (float32) runs serially in diffusers and in
parallel with float8 exchanges, under ulysses 2, ring 2 and ulysses 2 × ring 2, on an uneven image and
text. The error relative to the reference's largest value stays under the family's bound (set from the
measurement, about 1.5× the largest seen); the control, each row unpacked with its neighbour's scale
(Controls.wrong_comm_scales), exceeds it. Every rank's bytes per group equal the closed form
(xdit_lab/traffic.py: a row of head_dim elements is head_dim + 4 bytes), below the float32 run's.
With comm_dtype None nothing changes (tests/test_models.py, tests/test_uneven_heads.py stay exact).
"""

import re

import pytest
import torch
from forward_traffic import sample, traffic_mismatches, traffic_row

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, comm_log, parallelize
from xdit_lab.models import Controls
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

FP8 = "float8_e4m3fn"
# The largest error relative to max |reference| each family's forward may show with float8 exchanges: 1.5× the
# largest measured over the three configurations (measured: flux 1.31e-3, qwenimage 1.16e-3, pixart 1.70e-3,
# sd3 5.6e-4, wan 2.06e-3). The control's smallest: 7.7e-3, 9.7e-3, 8.2e-3, 3.6e-3, 3.4e-2.
BOUNDS = {"flux": 2e-3, "qwenimage": 1.75e-3, "pixart": 2.5e-3, "sd3": 8.5e-4, "wan": 3.1e-3}
CONFIGS = {
    2: [ParallelConfig(ulysses=2, comm_dtype=FP8), ParallelConfig(ring=2, comm_dtype=FP8)],
    4: [ParallelConfig(ulysses=2, ring=2, comm_dtype=FP8)],
}


def _relative(out, reference) -> float:
    return ((out - reference).abs().max() / reference.abs().max()).item()


def _measure(families, configs):
    """Per family and config: the float8 run's error, the control's, its traffic beside the closed form,
    and the bytes the same run moves in float32."""
    rows = []
    for family in families:
        for config in configs:
            mesh = RankMesh(config)
            inputs = tiny_inputs(family, 2, height=6, width=6, text_len=7)
            runs = {}
            for name, run_config, controls in (
                ("fp8", config, Controls()),
                ("control", config, Controls(wrong_comm_scales=True)),
                ("exact", config.replace(comm_dtype=None), Controls()),
            ):
                model = tiny_transformer(family)
                with torch.no_grad():
                    reference = sample(model(**inputs))
                model = parallelize(
                    model, run_config, RankMesh(run_config) if run_config != config else mesh, controls=controls
                )
                with torch.no_grad(), comm_log() as log:
                    output = sample(model(**inputs))
                runs[name] = dict(error=_relative(output, reference), **traffic_row(model, inputs, log, 0))
            rows.append(dict(where=f"{family} {config.short()}", **runs))
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_exchanges_are_bounded_counted_and_the_wrong_scale_is_caught(world_size):
    families = sorted(BOUNDS)
    for rank, rows in enumerate(run_on_ranks(_measure, world_size, families, CONFIGS[world_size], timeout_s=300)):
        for row in rows:
            where, bound = f"{row['where']} rank {rank}", BOUNDS[row["where"].split()[0]]
            assert 0 < row["fp8"]["error"] <= bound, (where, row["fp8"]["error"])
            assert row["control"]["error"] > bound, (where, row["control"]["error"])
            assert row["exact"]["error"] < 1e-4, (where, row["exact"]["error"])
            for name in ("fp8", "control", "exact"):
                assert not traffic_mismatches([row[name]], f"{where} {name}")
            for group, sent in row["fp8"]["moved"].items():  # float8: fewer bytes than float32 on sp's links
                if group in ("ulysses", "ring"):
                    assert sent < row["exact"]["moved"][group] / 2, (where, group)


def test_a_packed_row_is_off_by_half_a_float8_ulp_at_most():
    """Per element: |x' - x| <= 2^-4·|x| (normal), or 2^-10 of the row's scale (subnormal), rows with an
    outlier token among them; the neighbour's scale (the control) breaks the bound; zeros stay zeros."""
    from xdit_lab.attention.wire import Wire

    torch.manual_seed(0)
    x = torch.randn(64, 16) * torch.logspace(-3, 3, 64).unsqueeze(1)  # rows six decades apart
    x[5, 3], x[7] = 1e4, 0.0  # an outlier, an all-zero row
    wire = Wire.of(FP8)
    packed = wire.pack(x, 16)
    assert packed.dtype == torch.uint8 and packed.numel() == wire.packed_size(x.numel(), 16) == 64 * 20
    back = wire.unpack(packed, 16, torch.float32).view(64, 16)
    scale = x.abs().amax(dim=1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    allowed = torch.maximum(x.abs() / 16, scale / 1024)
    assert ((back - x).abs() <= allowed).all()
    assert (back[7] == 0).all()
    wrong = Wire.of(FP8, wrong_scales=True).unpack(packed, 16, torch.float32).view(64, 16)
    assert ((wrong - x).abs() > allowed).float().mean() > 0.75  # 0.84: rows whose amax is near their neighbour's pass


def _whole_text():
    """Flux under ulysses 2 × ring 2 in float8 with its text whole on every rank (Controls(shards_text=False)): the
    text output rides in o's all-to-all in float8, Ring's text partials are gathered in float32."""
    config = ParallelConfig(ulysses=2, ring=2, comm_dtype=FP8)
    model = tiny_transformer("flux")
    inputs = tiny_inputs("flux", 2, height=6, width=6, text_len=7)
    with torch.no_grad():
        reference = sample(model(**inputs))
    model = parallelize(model, config, RankMesh(config), controls=Controls(shards_text=False))
    with torch.no_grad(), comm_log() as log:
        output = sample(model(**inputs))
    return dict(error=_relative(output, reference), **traffic_row(model, inputs, log, 0))


def test_whole_text_in_float8_is_bounded_and_counted():
    for rank, row in enumerate(run_on_ranks(_whole_text, 4, timeout_s=180)):
        assert 0 < row["error"] <= BOUNDS["flux"], (rank, row["error"])
        assert not traffic_mismatches([row], f"rank {rank}")
        assert {"ulysses", "ring"} <= set(row["moved"]), row


def test_comm_dtype_is_validated_by_name():
    with pytest.raises(ParallelConfigError, match="comm_dtype 'float8' is not a format"):
        ParallelConfig(ulysses=2, comm_dtype="float8").validate()
    with pytest.raises(ParallelConfigError, match="not of PipeFusion's stale attention"):
        ParallelConfig(pipefusion=2, ulysses=2, comm_dtype=FP8).validate()
    assert ParallelConfig(ulysses=2, comm_dtype=FP8).short() == "ulysses2·fp8"
    assert (
        repr(ParallelConfig(ulysses=2))
        == "ParallelConfig(dp=1, cfg=1, pipefusion=1, ring=1, ulysses=2, num_patches=None, warmup_steps=1)"
    )


def test_cost_model_counts_float8_on_the_sp_links_only():
    """Ulysses' and Ring's terms weigh (1 + 4/d)/e of their elements, PipeFusion's stay whole; the planner
    gives float8 to the configurations whose sp links carry it."""
    wire = (1 + 4 / 128) / 2  # head_dim 128, bfloat16
    for config in (ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(ulysses=2, ring=2)):
        exact, fp8 = config.cost(57, num_heads=24), config.replace(comm_dtype=FP8).cost(57, num_heads=24)
        assert fp8.comm_p_hs == pytest.approx(exact.comm_p_hs * wire), config
        assert fp8.work_fraction == exact.work_fraction
    pf = ParallelConfig(pipefusion=2)
    assert pf.replace(comm_dtype=FP8).cost(57).comm_p_hs == pf.cost(57).comm_p_hs  # no sp link: nothing changes
    ranked = {c.short(): c for c in ParallelConfig.options(4, num_heads=24, num_layers=57, comm_dtype=FP8)}
    assert ranked["ulysses4·fp8"].comm_dtype == FP8 and ranked["ring2·ulysses2·fp8"].comm_dtype == FP8
    assert ranked["pf2·ulysses2"].comm_dtype is None and ranked["cfg2·pf2"].comm_dtype is None


def test_plan_flag_ranks_with_float8(capsys):
    from xdit_lab.cli import main

    assert main(["plan", "--world-size", "2", "--heads", "24", "--layers", "57", "--no-cfg", "--comm-dtype", FP8]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"ulysses2·fp8 .* 29\.4 ", printed), printed  # 57 · (1 + 4/128) / 2
    assert main(["plan", "--world-size", "2", "--heads", "24", "--layers", "57", "--no-cfg"]) == 0
    assert re.search(r"ulysses2 .* 57 ", capsys.readouterr().out)


def test_run_command_carries_float8(tmp_path):
    """`xdit-lab run --ulysses 2 --comm-dtype float8_e4m3fn` on 2 ranks: each step's Ulysses bytes are the
    exact run's × (d + 4)/(d·e) (tiny pixart: head_dim 16, float32), and the image is the exact run's, nearly."""
    import json

    import numpy as np
    from PIL import Image

    from xdit_lab.lessons import production
    from xdit_lab.testing import run_cli
    from xdit_lab.tiny import HEAD_DIM, save_tiny_pipeline, tiny_pipeline_kwargs

    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    kwargs = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=2, guidance_scale=3.0)
    reports, images = {}, {}
    for name, config in (("exact", ParallelConfig(ulysses=2)), ("fp8", ParallelConfig(ulysses=2, comm_dtype=FP8))):
        output = tmp_path / name
        job = run_cli(production.run_argv(folder, ["a red cat"], config, output, seed=7, **kwargs), 2, timeout_s=240)
        assert job.codes == [0, 0], job
        reports[name] = json.loads((output / "report.json").read_text())
        images[name] = np.asarray(Image.open(output / "000.png")).astype(float)
    assert reports["fp8"]["config_short"] == "ulysses2·fp8"
    for exact, fp8 in zip(reports["exact"]["ranks"], reports["fp8"]["ranks"]):
        for step_exact, step_fp8 in zip(exact["bytes_out_by_phase"]["per_step"], fp8["bytes_out_by_phase"]["per_step"]):
            assert step_fp8["ulysses"] * 4 * HEAD_DIM == step_exact["ulysses"] * (HEAD_DIM + 4)
    assert np.abs(images["fp8"] - images["exact"]).max() <= 8  # of 255: the approximation, seen in pixels


def _bfloat16_at_head_dim_128():
    """tiny Flux with the real models' head dim (128) in bfloat16 under ulysses 2: the ulysses bytes with float8 on
    the wire, with the wrong scales (the control) and without, and each run's error against the bfloat16 serial
    forward (relative to its largest value)."""
    config = ParallelConfig(ulysses=2, comm_dtype=FP8)
    shape = dict(attention_head_dim=128, axes_dims_rope=(16, 56, 56))
    inputs = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in tiny_inputs("flux", 2, height=6, width=6, text_len=7).items()
        if isinstance(v, torch.Tensor)
    }
    rows = {}
    for name, run_config, controls in (
        ("fp8", config, Controls()),
        ("control", config, Controls(wrong_comm_scales=True)),
        ("bf16", config.replace(comm_dtype=None), Controls()),
    ):
        model = tiny_transformer("flux", heads=2, **shape).to(torch.bfloat16)
        with torch.no_grad():
            reference = sample(model(**inputs)).float()
        model = parallelize(model, run_config, RankMesh(run_config), controls=controls)
        with torch.no_grad(), comm_log() as log:
            output = sample(model(**inputs)).float()
        rows[name] = dict(error=_relative(output, reference), **traffic_row(model, inputs, log, 0))
    return rows


def test_fp8_ulysses_sends_at_most_0_55_of_bfloat16_at_head_dim_128():
    """The issue's target on the step's own bytes: at head dim 128 in bfloat16 the ulysses all-to-alls carry
    (128 + 4) / 256 = 0.516 of bfloat16's, measured and as the closed form; the error stays within Flux's float8
    bound over bfloat16's own, and the wrong scales (the control) exceed it."""
    for rank, rows in enumerate(run_on_ranks(_bfloat16_at_head_dim_128, 2, timeout_s=240)):
        for name, row in rows.items():
            assert not traffic_mismatches([row], f"rank {rank} {name}")
        ratio = rows["fp8"]["moved"]["ulysses"] / rows["bf16"]["moved"]["ulysses"]
        assert ratio == pytest.approx((128 + 4) / 256) and ratio <= 0.55, (rank, ratio)
        bound = rows["bf16"]["error"] + BOUNDS["flux"]
        assert rows["fp8"]["error"] <= bound < rows["control"]["error"], (rank, rows)
