"""xdit-lab demo: the ten digits, drawn by the bundled model under a parallel strategy.

Spawns N local ranks (CPU processes over gloo, or one per visible GPU over nccl), runs the same
`run_generation` as `xdit-lab run` under torchrun, then lays the ten images out as one grid,
lets an independent classifier read them, and prints where everything is and what each rank
held and sent.
"""

from __future__ import annotations

from pathlib import Path

from .config import GRID, ParallelConfig


def default_config(ranks: int) -> ParallelConfig:
    """The cost model's best exact strategy for `ranks` (PipeFusion trades quality, so it is opt-in)."""
    import json

    from .digits.components import DIGITS_DIR

    transformer = json.loads((Path(DIGITS_DIR) / "transformer" / "config.json").read_text())
    tokens = (transformer["sample_size"] // transformer["patch_size"]) ** 2
    options = ParallelConfig.options(
        ranks,
        num_heads=transformer["num_attention_heads"],
        num_layers=transformer["num_layers"],
        seq_len=tokens,
        batch=10,
    )
    return next(c for c in options if c.pipefusion == 1)


def _demo_rank(config, output, steps, seed):
    from .digits.components import prompt_for
    from .load_options import LoadOptions
    from .pipeline import loading_bars_hidden
    from .run import run_generation

    with loading_bars_hidden():  # size, steps, guidance and negative prompt: the model folder's own
        return run_generation(
            "digits",
            [prompt_for(d) for d in range(10)],
            config,
            output,
            load_options=LoadOptions(progress=False),
            steps=steps,
            seed=seed,
        )


def run_demo(
    config: ParallelConfig | None = None,
    ranks: int | None = None,
    output="outputs/demo",
    *,
    steps: int | None = None,
    seed: int = 0,
    timeout_s: float = 900,
) -> dict:
    import torch

    from .testing import run_on_ranks

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ranks is None:
        ranks = config.world_size if config is not None else (min(gpus, 4) if gpus else 2)
    config = config or default_config(ranks)
    config.validate()
    if config.world_size > ranks:
        raise ValueError(f"{config.short()} needs {config.world_size} ranks; pass --ranks {config.world_size}")
    output = Path(output)
    reports = run_on_ranks(
        _demo_rank,
        ranks,
        config,
        str(output),
        steps,
        seed,
        timeout_s=timeout_s,
        backend="nccl" if gpus >= ranks else "gloo",
    )
    report = next(r for r in reports if r is not None)
    report["grid"], report["accuracy"] = _grid_and_accuracy(output, report["outputs"])
    return report


def _grid_and_accuracy(output: Path, names: list[str]) -> tuple[str, float]:
    import numpy as np
    from PIL import Image, ImageDraw

    from .digits.classifier import classify
    from .output_folder import atomic_write

    pictures = [Image.open(output / name).convert("RGB") for name in names]
    read = classify(pictures)
    images = [picture.convert("L") for picture in pictures]
    scale, label = 6, 14
    side = images[0].width * scale
    grid = Image.new("L", (5 * side, 2 * (side + label)), color=255)
    draw = ImageDraw.Draw(grid)
    for digit, (image, seen) in enumerate(zip(images, read)):
        x, y = (digit % 5) * side, (digit // 5) * (side + label)
        grid.paste(image.resize((side, side), Image.NEAREST), (x, y + label))
        draw.text((x + 2, y + 1), f"{digit} (read {seen})", fill=0)
    atomic_write(output / "digits_grid.png", lambda p: grid.save(p, format="PNG"))
    return str(output / "digits_grid.png"), float(np.mean(np.asarray(read) == np.arange(10)))


def print_report(report: dict) -> None:
    t = report["timings"]
    print(
        f"{report['pipeline']} under {report['config_short']} on {len(report['ranks'])} rank(s): encode "
        f"{t['encode']:.2f} s, denoise {t['denoise']:.2f} s over {len(t['steps'])} steps, decode {t['decode']:.2f} s"
    )
    print(f"{'rank':>4}  {'mesh':<40} {'params MB':>9} {'peak MB':>8}  bytes sent: last step | encode | decode")
    for r in report["ranks"]:
        memory = r["memory"]
        peak = memory.get("max_allocated", memory.get("peak_rss", 0)) / 1e6
        phases = r["bytes_out_by_phase"]
        sent = " | ".join(
            ", ".join(f"{g} {b:,}" for g, b in sorted(by_group.items()) if b) or "nothing"
            for by_group in (phases["per_step"][-1], phases["encode"], phases["decode"])
        )
        print(f"{r['rank']:>4}  {r['mesh']:<40} {memory['parameter_total'] / 1e6:>9.2f} {peak:>8.0f}  {sent}")
    print(f"the classifier reads {report['accuracy'] * 10:.0f} of the 10 digits as prompted")
    print(f"grid: {report['grid']}\nimages and report.json: {Path(report['grid']).parent}")


def config_from_args(args) -> ParallelConfig | None:
    degrees = {d: getattr(args, d) for d in GRID if getattr(args, d) is not None}
    if not degrees:
        return None
    return ParallelConfig(**degrees, num_patches=args.num_patches, warmup_steps=args.warmup_steps)
