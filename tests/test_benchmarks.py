"""The benchmarks run as their docstrings show, on a tiny size, and what they report holds: finite
timings, every method within 1e-4 of serial, our bytes equal to the closed form, diffusers' refusals
named, rows per rank at most diffusers' with the control above. (Speed itself is the benchmark's to
report, not a test's.)"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_peers_benchmark_on_a_tiny_size(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/peers.py",
            "--tokens",
            "64",
            "--ranks",
            "2",
            "--repeats",
            "1",
            "--text-tokens",
            "24",
        ]
        + ["--pipeline-steps", "2", "--json", str(out), "--markdown", str(tmp_path / "t.md")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    timed = [r for r in rows if "ms" in r]
    assert {(r["family"], r["method"]) for r in timed} >= {
        ("flux", "diffusers ulysses2"),
        ("flux", "ours ulysses2"),
        ("flux", "ours ring2"),
        ("pixart", "ours ulysses2"),
        ("flux pipe", "diffusers ulysses2"),
        ("flux pipe", "ours ring2"),
    }
    assert {r["text_tokens"] for r in timed if r["kind"] == "transformer"} == {24}
    for r in timed:
        assert all(math.isfinite(ms) and ms > 0 for ms in r["ms"] + r["serial_ms"]), r
        assert r["max_rel_error"] < 1e-4, r
        if r["method"].startswith("ours") and r["kind"] == "transformer":
            assert r["bytes_sent"] == r["closed_form"], r
    refused = {(r["family"], r["method"]): r["refused"] for r in rows if "refused" in r}
    assert "return_lse" in refused[("flux", "diffusers ring2")]
    assert "cp_plan" in refused[("pixart", "diffusers ulysses2")]
    assert "| ours ulysses2 |" in (tmp_path / "t.md").read_text()


# benchmarks/compile.py is not run here: what it reports of correctness (compiled parallel forwards equal
# to eager, one graph, no recompiles) is tests/test_compile.py's claim, on more families, with a control;
# the compile itself (39 s of inductor at the smallest size) is the benchmark's cost, not a test's.


def test_pipefusion_schedule_benchmark_on_a_tiny_size(tmp_path):
    """benchmarks/pipefusion_schedule.py on 10 digits and 4 steps: both schedules timed (finite), each
    stage's bubble a share in [0, 1) beside the closed form for 2 stages and 2 patches (drained 1/3 of a
    step; async 1/7 over its 3 pipelined steps), and the async latents equal to the drained ones."""
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/pipefusion_schedule.py", "--per-digit", "1", "--steps", "4"]
        + ["--patches", "2", "--repeats", "1", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    drained, pipelined = json.loads(out.read_text())
    assert (drained["config"], pipelined["config"]) == ("pf2", "pf2·async")
    for row in (drained, pipelined):
        assert math.isfinite(row["median_s"]) and row["median_s"] > 0, row
        # each stage recorded time in its blocks (b < 1) and time outside them (b > 0: the pipeline fills
        # and drains, the last stage steps the scheduler), over the steps the stage counted as pipelined:
        # 3 (4 steps, 1 warmup), 2 stages, 2 patches
        assert len(row["bubble_by_stage"]) == 2 and all(0 < b < 1 for b in row["bubble_by_stage"]), row
        assert (row["stages"], row["patches"], row["pipelined_steps"]) == (2, 2, 3), row
    # the closed forms at N 2, M 2, K 3, worked out by hand: drained (N-1)/(M+N-1), async (N-1)/(K·M+N-1),
    # async over drained (K·M+N-1)/(K·(M+N-1))
    assert drained["closed_form_bubble"] == 1 / 3 and pipelined["closed_form_bubble"] == 1 / 7
    assert abs(pipelined["closed_form_vs_drained"] - 7 / 9) < 1e-12
    assert pipelined["deviation"] < 1e-4
    assert "| pf2·async | 2 | 3 |" in done.stdout


def test_peers_on_cuda_without_a_gpu_says_so():
    done = subprocess.run(
        [sys.executable, "benchmarks/peers.py", "--device", "cuda", "--tokens", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 2 and "--device cuda: torch sees no CUDA GPU here" in done.stderr, done.stderr[-2000:]


def test_host_overhead_benchmark_on_a_tiny_size(tmp_path):
    """benchmarks/host_overhead.py on the fake process group, 1 + 1 blocks, one repeat: every method timed
    (finite), in one fresh process per world, and the issue's three ratios computed from its medians."""
    out = tmp_path / "host.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/host_overhead.py", "--ranks", "2", "--repeats", "1", "--double", "1"]
        + ["--single", "1", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (world,) = json.loads(out.read_text())
    assert world["world"] == 2
    assert set(world["ms"]) == {"serial", "diffusers ulysses2", "ours ulysses2", "ours ring2", "ours serial"}
    assert all(len(ms) == 1 and math.isfinite(ms[0]) and ms[0] > 0 for ms in world["ms"].values()), world
    medians = {name: ms[0] for name, ms in world["ms"].items()}
    assert world["ratios"]["ring / ulysses"] == medians["ours ring2"] / medians["ours ulysses2"]
    assert set(world["ratios"]) == {
        "ours ulysses / diffusers ulysses",
        "ring / ulysses",
        "ours every degree 1 / serial",
    }
    assert "| 2 | ring / ulysses |" in done.stdout


def test_host_overhead_gpu_busy_time_is_the_union_of_each_forwards_kernels():
    """host_overhead.py's GPU figure (--device cuda), from profiler intervals: each forward's kernels, cut at
    the forwards' starts, counted once where they overlap (kernels on two streams), against the same union
    counted microsecond by microsecond. The control: summing the intervals counts overlaps twice."""
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("host_overhead", ROOT / "benchmarks" / "host_overhead.py")
    host_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_overhead)
    rng = random.Random(0)
    starts = [0, 1000, 2000]
    kernels = sorted(
        (start + a, start + a + rng.randint(1, 80)) for start in starts for a in rng.sample(range(5, 900), 40)
    )
    busy = host_overhead.union_per_call(kernels, starts)
    for start, ms in zip(starts, busy):
        mine = [k for k in kernels if start <= k[0] < start + 1000]
        covered = len({us for s, e in mine for us in range(s, e)})
        assert math.isclose(ms * 1e3, covered), (start, ms, covered)
        assert sum(e - s for s, e in mine) > covered  # the control: overlapping kernels exist and would count twice


def test_linear_rows_benchmark_on_a_tiny_size(tmp_path):
    """benchmarks/linear_rows.py with FLUX.1-dev's width on `meta`, 1 + 1 blocks, 64 image and 24 text
    tokens, ulysses 2: our rows and FLOPs through the blocks' linear layers per rank at most diffusers'
    context parallelism's, about half the serial ones; the control (text whole on every rank) above
    diffusers' by the text's other half at every text-row linear layer. The whole forward's FLOPs differ
    from diffusers' by the patch embedding of the other rank's image tokens only."""
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/linear_rows.py", "--ranks", "2", "--double", "1", "--single", "1"]
        + ["--image-tokens", "64", "--text-tokens", "24", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    serial, peer = rows["serial"], rows["diffusers ulysses2"]
    ours, control = rows["ours ulysses2"], rows["ours ulysses2, text whole (control)"]
    for key in ("rows", "linear_flops"):
        assert 0 < ours[key] <= peer[key] < control[key] < serial[key], (key, rows)
    # the whole forward: the same but for the patch embedding (x_embedder, 64 -> 3072), which ours runs on
    # all 64 image tokens before keeping its 32 (diffusers splits hidden_states at the forward's input)
    assert ours["forward_flops"] - peer["forward_flops"] == 2 * 32 * 64 * 3072, rows
    assert peer["forward_flops"] < control["forward_flops"] < serial["forward_flops"], rows
    assert ours["rows"] <= 0.51 * serial["rows"], rows
    # the double block's 6 text-stream linears (add_q/k/v, to_add_out, ff_context's 2) and the single block's
    # 5 token linears (to_q/k/v, proj_mlp, proj_out) each take the other rank's 12 text rows in the control;
    # adaLN's modulation linears take one row per sample either way
    assert control["rows"] - ours["rows"] == 12 * (6 + 5), rows


def test_accelerations_benchmark_on_a_tiny_size(tmp_path):
    """benchmarks/accelerations.py at one StepCache threshold on the digits and 4 tiny-Flux steps: every method has
    its row (the ranks agreed on every skip, or the run raised), the uncached rows equal themselves, our StepCache
    equals diffusers' First-Block Cache at the same threshold (the same method), float8 on the wire sends under 0.55
    of the uncached bytes with the digits still read, diffusers' configurations are refused by name on PixArt (no
    CacheMixin), and under PipeFusion TaylorSeer, MagCache and PAB run while First-Block Cache and DBCache are refused
    by name."""
    out, picture = tmp_path / "rows.json", tmp_path / "plot.png"
    done = subprocess.run(
        [sys.executable, "benchmarks/accelerations.py", "--thresholds", "0.2", "--flux-steps", "4"]
        + ["--repeats", "1", "--json", str(out), "--plot", str(picture)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    measured = {(r["model"], r["method"], r["setting"]): r for r in rows if "refused" not in r}
    methods = {(model, method) for model, method, _ in measured}
    assert methods >= {
        ("digits ulysses2", "StepCache"),
        ("digits ulysses2", "fp8 comm"),
        ("digits ulysses2", "DBCache"),
        ("tiny flux ulysses2", "DBCache"),
        ("digits pf2", "StepCache"),
        ("tiny flux ulysses2", "FirstBlockCache"),
        ("tiny flux ulysses2", "TaylorSeer"),
        ("tiny flux ulysses2", "MagCache"),
        ("tiny flux ulysses2", "PAB"),
        ("tiny flux ulysses2", "FasterCache"),
        ("tiny flux ulysses2", "TeaCache"),
        ("digits ulysses2", "TeaCache"),
        ("tiny flux ulysses2", "fp8 comm"),
        ("tiny flux pf2", "StepCache"),
        ("tiny flux pf2", "TaylorSeer"),
        ("tiny flux pf2", "MagCache"),
        ("tiny flux pf2", "PAB"),
    }, methods
    for (_, method, _), r in measured.items():
        assert math.isfinite(r["seconds"]) and r["seconds"] > 0, r
        if method == "none":
            assert r["rel_l2"] == 0 and r["skipped"] == 0 and r.get("accuracy", "") in ("", "10/10"), r
    for t in ("0.45", "0.52", "0.6"):
        ours, theirs = (measured[("tiny flux ulysses2", m, f"threshold {t}")] for m in ("StepCache", "FirstBlockCache"))
        assert (ours["skipped"], ours["bytes"]) == (theirs["skipped"], theirs["bytes"]), (ours, theirs)
        assert abs(ours["rel_l2"] - theirs["rel_l2"]) <= 1e-4, (ours, theirs)
    for model in ("digits ulysses2", "tiny flux ulysses2"):
        fp8, base = measured[(model, "fp8 comm", "float8_e4m3fn")], measured[(model, "none", "uncached")]
        assert fp8["bytes"] <= 0.55 * base["bytes"] and 0 < fp8["rel_l2"] < 0.05, (fp8, base)
    assert measured[("digits ulysses2", "fp8 comm", "float8_e4m3fn")]["accuracy"] == "10/10"
    refusals = {(r["model"], r["method"]): r["refused"] for r in rows if "refused" in r}
    assert "has no CacheMixin" in refusals[("digits ulysses2", "diffusers' caches")]
    assert "FirstBlockCacheConfig does not run under PipeFusion" in refusals[("tiny flux pf2", "FirstBlockCache")]
    for model in ("digits pf2", "tiny flux pf2"):
        assert "StepCache(method='dbcache') does not run under PipeFusion" in refusals[(model, "DBCache")]
    assert picture.stat().st_size > 0 and "| digits ulysses2 | StepCache | threshold 0.2 |" in done.stdout
