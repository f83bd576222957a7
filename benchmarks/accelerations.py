"""Every acceleration xdit_lab runs, on the digits model and tiny Flux: forwards skipped against quality and time.

    python benchmarks/accelerations.py [--per-digit 1] [--flux-steps 8] [--repeats 3] [--plot PNG]

Each row is one run on 2 ranks (gloo, this machine's cores) beside the uncached run of the same configuration in the
same invocation: our StepCache at a few thresholds (First-Block Cache, and DBCache with one front block, one back
block and a first-order TaylorSeer: DBCACHE; TeaCache), diffusers' FirstBlockCacheConfig, TaylorSeerCacheConfig,
MagCacheConfig (mag_ratios, one per step), PyramidAttentionBroadcastConfig and FasterCacheConfig (its attention
cache) through `load_pipeline(..., cache=config)`, and float8 on Ulysses' wire (`ParallelConfig(ulysses=2, comm_dtype="float8_e4m3fn")`). Per row: the
steps at which the cache skipped a computation, of the steps run (StepCache and First-Block Cache skip every block
after the first, TeaCache every block, MagCache the blocks, TaylorSeer predicts its blocks' outputs, PAB reuses
attention, FasterCache extrapolates it), the bytes
one rank sent in the run (every group, the cache's own all-reduces included), the denoising seconds (the fastest of
--repeats runs) and their ratio to the uncached run's, the relative L2 of the final latents against the uncached run
(same seeds), PSNR and SSIM of the decoded images against it (xdit_lab.compare) and, on the digits, how many the
independent classifier reads as the prompted digit. A configuration a family or a strategy does not take is a row
saying so, in the refusal's own words: the digits model is PixArt, whose transformer has no CacheMixin (no diffusers
cache), and PipeFusion takes StepCache, TaylorSeer, MagCache and PAB (a hook state per patch), not First-Block Cache
or DBCache. Under PipeFusion a skipped step still sends every patch through the stages (only the blocks' compute is
skipped), so its bytes stay. Ranks share this machine's cores with whatever else
runs: read the seconds as ratios within a configuration. The plot (--plot, default benchmarks/accelerations.png):
PSNR against speed-up, one line per method, a panel per model and configuration.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time

from xdit_lab import ParallelConfig, StepCache
from xdit_lab.testing import run_on_ranks

ULYSSES, FP8 = ParallelConfig(ulysses=2), ParallelConfig(ulysses=2, comm_dtype="float8_e4m3fn")
PF2 = ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1)
DBCACHE = dict(method="dbcache", front=1, back=1, taylor_order=1)  # DBCache's rows: StepCache(t, **DBCACHE)
TEACACHE_THRESHOLDS = (0.1, 0.3)  # TeaCache's accumulated change (its coefficients the identity: none published here)
PSNR_CAP = 80.0  # the plot's ceiling: an image equal to the uncached one has PSNR inf


def _diffusers_methods(steps):
    """(method, setting, configuration) of diffusers' hooks on tiny Flux, each at a few settings (SeaCache runs
    where the pipeline hands its hooks a sigma, WanPipeline, not on Flux)."""
    import torch
    from diffusers.hooks import (
        FasterCacheConfig,
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )

    rows = [("FirstBlockCache", f"threshold {t:g}", FirstBlockCacheConfig(threshold=t)) for t in (0.45, 0.52, 0.6)]
    rows += [
        (
            "TaylorSeer",
            f"interval {i}",
            TaylorSeerCacheConfig(cache_interval=i, disable_cache_before_step=2, taylor_factors_dtype=torch.float32),
        )
        for i in (2, 3)
    ]
    # a measured MagCache would calibrate serially first; these ratios (each step's residual a tenth smaller than
    # the last's) stand in for a calibration, one per step as MagCacheConfig asks
    ratios = [1.0] + [0.9] * (steps - 1)
    rows += [
        ("MagCache", f"threshold {t:g}", MagCacheConfig(threshold=t, num_inference_steps=steps, mag_ratios=ratios))
        for t in (0.1, 0.5)
    ]
    rows += [
        (
            "PAB",
            f"skip range {r}",
            PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=r, spatial_attention_timestep_skip_range=(0, 1000)
            ),
        )
        for r in (2, 3)
    ]
    rows += [  # its attention cache alone: Flux is guidance-distilled (the CFG-Cache is refused on several ranks)
        (
            "FasterCache",
            f"skip range {r}",
            FasterCacheConfig(
                spatial_attention_block_skip_range=r,
                spatial_attention_timestep_skip_range=(-1, 1000),
                is_guidance_distilled=True,
            ),
        )
        for r in (2, 3)
    ]
    return rows


def _run(folder, config, cache, call):
    """On a rank: one run of `folder` under `config` with `cache`; what the row reports, from this rank."""
    import numpy as np

    from xdit_lab import RankMesh, load_pipeline
    from xdit_lab.pipeline import loading_bars_hidden

    with loading_bars_hidden():  # a bar per component per rank per run would bury the table
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=cache)
    session = pipe.session(**call).run()
    images = session.result(output_type="np").images
    row = dict(
        latents=session.latents.to("cpu", copy=True),
        images=(np.clip(images, 0, 1) * 255).round().astype(np.uint8),
        skips=list(session.cache_skips),
        bytes=sum(sum(step.values()) for step in session.comm_per_step),
        seconds=sum(session.timings.steps),
    )
    pipe.close()
    return row


def run_all(folder, config, runs, call, repeats):
    """On every rank: the uncached run under `config`, then one per (config, cache) of `runs` (one launch), after a
    warm-up run."""
    import torch

    if "generator" in call:  # generators are consumed: a fresh set for every run, the same seeds
        seeds = call.pop("generator")
        fresh = lambda: dict(call, generator=[torch.Generator().manual_seed(s) for s in seeds])  # noqa: E731
    else:
        fresh = lambda: dict(call)  # noqa: E731 (seed= in the call)
    _run(folder, config, None, fresh())  # discarded: the first run in a process pays its imports and allocations
    rows = []
    for c, cache in [(config, None), *runs]:
        row = _run(folder, c, cache, fresh())
        # the fastest of `repeats` runs (the same latents each time): other work on these cores only adds time
        row["seconds"] = min(
            [row["seconds"]] + [_run(folder, c, cache, fresh())["seconds"] for _ in range(repeats - 1)]
        )
        rows.append(row)
    return rows


def measure(name, folder, config, methods, call, repeats, digits=None):
    """Rows of (method, setting, cache[, config]) against the uncached run under `config`, on 2 ranks."""
    runs = [(m[3] if len(m) > 3 else config, m[2]) for m in methods]
    per_rank = run_on_ranks(run_all, config.world_size, folder, config, runs, call, repeats, timeout_s=1800)
    for rank in per_rank[1:]:
        for mine, first in zip(rank, per_rank[0]):
            if mine["skips"] != first["skips"]:
                raise AssertionError(f"{name}: ranks disagree on the skipped steps: {first['skips']}, {mine['skips']}")
    base, *runs = per_rank[0]
    return [
        _row(name, method, setting, run, base, digits)
        for (method, setting, *_), run in zip([("none", "uncached", None), *methods], [base, *runs])
    ]


def _row(name, method, setting, run, base, digits):
    from xdit_lab.compare import compare_images

    quality = compare_images(base["images"], run["images"])
    row = dict(
        model=name,
        method=method,
        setting=setting,
        skipped=sum(run["skips"]),
        steps=len(run["skips"]),
        bytes=run["bytes"],
        seconds=run["seconds"],
        time_ratio=run["seconds"] / base["seconds"],
        rel_l2=((run["latents"] - base["latents"]).norm() / base["latents"].norm()).item(),
        psnr=quality["psnr"],
        ssim=quality["ssim"],
    )
    if digits is not None:
        from xdit_lab.digits.classifier import classify

        row["accuracy"] = f"{sum(int(r == d) for r, d in zip(classify(run['images']), digits))}/{len(digits)}"
    return row


def _refusals(name, folder, config, caches):
    """What load_pipeline says of each cache on this folder and config, asked before a weight is read."""
    from xdit_lab import LoadOptions
    from xdit_lab.families import recipe_for
    from xdit_lab.model_folder import read_model_folder, resolve_folder

    read = read_model_folder(resolve_folder(folder))
    recipe = recipe_for(read.pipeline_class)
    rows = []
    for method, cache in caches:
        problems = "; ".join(map(str, LoadOptions(cache=cache).problems(recipe, read, config)))
        rows.append(dict(model=name, method=method, setting="refused", refused=problems or "(not refused)"))
    return rows


def markdown(rows):
    lines = [
        "| model, strategy | method | setting | skipped | bytes sent / rank | denoise s | vs uncached | rel. L2 "
        "| PSNR dB | SSIM | digits read |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['model']} | {r['method']} | refused: {r['refused']} |" + " |" * 8)
            continue
        lines.append(
            f"| {r['model']} | {r['method']} | {r['setting']} | {r['skipped']} of {r['steps']} | {r['bytes']:,} | "
            f"{r['seconds']:.2f} | {r['time_ratio']:.2f} | {r['rel_l2']:.4f} | {r['psnr']:.1f} | {r['ssim']:.3f} | "
            f"{r.get('accuracy', '')} |"
        )
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows if "refused" not in r))
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3), dpi=80, squeeze=False)
    for ax, model in zip(axes[0], models):
        measured = [r for r in rows if r["model"] == model and "refused" not in r]
        for method in dict.fromkeys(r["method"] for r in measured if r["method"] != "none"):
            points = sorted((1 / r["time_ratio"], min(r["psnr"], PSNR_CAP)) for r in measured if r["method"] == method)
            ax.plot(*zip(*points), marker="o", label=method)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("speed-up vs uncached")
        ax.set_ylabel(f"PSNR dB (capped {PSNR_CAP:g})")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-digit", type=int, default=1, help="images of each digit (seeds 0..n-1)")
    parser.add_argument("--flux-steps", type=int, default=8)
    parser.add_argument(
        "--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3], help="StepCache's on the digits"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the fastest one's seconds reported")
    parser.add_argument("--plot", default="benchmarks/accelerations.png", help="'' for none")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    from diffusers.hooks import FirstBlockCacheConfig

    from xdit_lab.digits import prompt_for
    from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs
    from xdit_lab.tools.calibrate import cpu_model

    start = time.perf_counter()
    digits = [d for d in range(10) for _ in range(args.per_digit)]
    digit_call = dict(
        prompt=[prompt_for(d) for d in digits], generator=[s for _ in range(10) for s in range(args.per_digit)]
    )
    step_caches = [("StepCache", f"threshold {t:g}", StepCache(t)) for t in args.thresholds]
    db_caches = [("DBCache", f"F1B1 taylor 1, threshold {t:g}", StepCache(t, **DBCACHE)) for t in args.thresholds]
    db_refused = [("DBCache", StepCache(args.thresholds[0], **DBCACHE))]
    tea_caches = [("TeaCache", f"threshold {t:g}", StepCache(t, method="teacache")) for t in TEACACHE_THRESHOLDS]
    rows = []
    # the digits: PixArt, no CacheMixin: StepCache and float8 on the wire, diffusers' configurations refused
    fp8 = [("fp8 comm", "float8_e4m3fn", None, FP8)]
    middle = sorted(args.thresholds)[len(args.thresholds) // 2]  # StepCache beside float8 at one threshold
    fp8_cached = ("fp8 comm + StepCache", f"threshold {middle:g}", StepCache(middle), FP8)
    rows += measure(
        "digits ulysses2",
        "digits",
        ULYSSES,
        step_caches + db_caches + tea_caches + fp8 + [fp8_cached],
        digit_call,
        args.repeats,
        digits,
    )
    rows += _refusals("digits ulysses2", "digits", ULYSSES, [("diffusers' caches", FirstBlockCacheConfig())])
    rows += measure("digits pf2", "digits", PF2, step_caches, digit_call, args.repeats, digits)
    rows += _refusals("digits pf2", "digits", PF2, db_refused)

    with tempfile.TemporaryDirectory() as tmp:
        flux = str(save_tiny_pipeline("flux", tmp))
        call = dict(
            tiny_pipeline_kwargs("flux"),
            prompt=["a red cat", "a blue dog"],
            seed=0,
            num_inference_steps=args.flux_steps,
        )
        flux_steps = [("StepCache", f"threshold {t:g}", StepCache(t)) for t in (0.45, 0.52, 0.6)]
        flux_db = [("DBCache", f"F1B1 taylor 1, threshold {t:g}", StepCache(t, **DBCACHE)) for t in (0.52, 0.6)]
        diffusers_caches = _diffusers_methods(args.flux_steps)
        flux_rows = flux_steps + flux_db + tea_caches + diffusers_caches + fp8
        rows += measure("tiny flux ulysses2", flux, ULYSSES, flux_rows, call, args.repeats)
        # under PipeFusion the schedule-decided ones run with a state per patch; First-Block Cache is refused
        by_schedule = [row for row in diffusers_caches if row[0] in ("TaylorSeer", "MagCache", "PAB")]
        rows += measure("tiny flux pf2", flux, PF2, flux_steps + by_schedule, call, args.repeats)
        rows += _refusals("tiny flux pf2", flux, PF2, [("FirstBlockCache", diffusers_caches[0][2]), *db_refused])

    print(
        f"On {cpu_model()}, 2 gloo ranks; digits: {len(digits)} images, 20 steps; tiny Flux: 2 prompts, "
        f"{args.flux_steps} steps; {time.perf_counter() - start:.0f} s in all\n"
    )
    print(markdown(rows))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if not (isinstance(v, float) and math.isinf(v))} for r in rows], f)


if __name__ == "__main__":
    main()
