"""What a configuration costs in quality: two runs of one prompts file, image by image.

    xdit-lab compare out/serial out/pipefusion2-warmup0 [--output DIR]

Both folders are `xdit-lab run --prompts` outputs. Their images are matched by id (records.jsonl), and each pair
gets scikit-image's PSNR and SSIM and the largest difference of a pixel (in 0-255 levels):

    serial/00007-0.png  <->  pipefusion2/00007-0.png   PSNR 38.1 dB  SSIM 0.991  largest difference 9
                                                       ...
    summary: mean PSNR and SSIM, the five with the lowest SSIM among the images that differ, and ids found in
             one run only

The comparison writes compare.json (every pair and the summary) and compare.png (the distribution of PSNR and
SSIM; identical images, whose PSNR is infinite, are counted apart) to DIR (default: RUN_B/compare). For the
bundled digits model, an independent classifier also reads each run's images, and the accuracy of each run is
reported beside the distances. Latent outputs (.pt) are compared by their largest difference and a PSNR over
the first run's range; SSIM is left out for them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from .output_folder import RECORDS_FILE, RUN_FILE, atomic_write

WORST = 5
DIGIT_PROMPT = re.compile(r"a handwritten (\d)")


class CompareError(ValueError):
    """A folder given to compare is not the output of `xdit-lab run --prompts`, or two runs share no image."""


def read_run(folder) -> tuple[dict, dict[str, dict]]:
    """A run folder's run.json and its records by id (only those whose file is there)."""
    folder = Path(folder).expanduser()
    run_file, records_file = folder / RUN_FILE, folder / RECORDS_FILE
    if not (run_file.is_file() and records_file.is_file()):
        raise CompareError(
            f"{folder} holds no {RUN_FILE} and {RECORDS_FILE}: give a folder `xdit-lab run --prompts FILE --output` wrote"
        )
    records = {}
    for line in records_file.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run: that image is not complete
        if (folder / record["file"]).is_file():
            records[record["id"]] = record
    return json.loads(run_file.read_text()), records


def _load(path: Path) -> np.ndarray:
    if path.suffix == ".pt":
        import torch

        return torch.load(path).float().numpy()
    from PIL import Image

    with Image.open(path) as image:
        if getattr(image, "n_frames", 1) > 1:  # a video's GIF: every frame, stacked
            frames = []
            for index in range(image.n_frames):
                image.seek(index)
                frames.append(np.asarray(image.convert("RGB")))
            return np.stack(frames)
        return np.asarray(image.convert("RGB"))


def compare_images(a: np.ndarray, b: np.ndarray) -> dict:
    """PSNR (dB, inf when equal), SSIM (images only) and the largest difference of `b` against `a`."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    if a.shape != b.shape:
        raise CompareError(f"shapes differ: {a.shape} and {b.shape} (were both runs drawn at the same size?)")
    largest = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
    if a.dtype == np.uint8:
        data_range = 255
        # SSIM over each frame of a video, averaged; the window shrinks for images smaller than 7 px
        frames = [(a, b)] if a.ndim == 3 else list(zip(a, b))
        side = min(a.shape[-3:-1])
        win = 7 if side >= 7 else side - (side % 2 == 0)
        ssim = float(
            np.mean(
                [structural_similarity(x, y, channel_axis=-1, data_range=data_range, win_size=win) for x, y in frames]
            )
        )
    else:
        data_range = float(a.max() - a.min()) or 1.0
        ssim = None
    psnr = math.inf if largest == 0 else float(peak_signal_noise_ratio(a, b, data_range=data_range))
    return dict(psnr=psnr, ssim=ssim, largest_difference=largest)


def compare_runs(run_a, run_b) -> dict:
    """Every image both runs hold, compared (compare_images), and a summary: means, the five with the lowest SSIM
    (lowest PSNR for latents) among those that differ (none when all are identical), ids in one run only and, for
    the digits model, each run's classifier accuracy."""
    (identity_a, records_a), (identity_b, records_b) = read_run(run_a), read_run(run_b)
    shared = sorted(set(records_a) & set(records_b))
    if not shared:
        raise CompareError(f"{run_a} and {run_b} share no image id: were they drawn from the same prompts file?")
    pairs = []
    for image_id in shared:
        a, b = records_a[image_id], records_b[image_id]
        row = compare_images(_load(Path(run_a) / a["file"]), _load(Path(run_b) / b["file"]))
        pairs.append(dict(id=image_id, prompt=a["prompt"], **row))
    finite = [p["psnr"] for p in pairs if math.isfinite(p["psnr"])]
    differing = [p for p in pairs if p["largest_difference"] > 0]  # an identical image is no one's "worst"
    ranked = sorted(differing, key=lambda p: (p["ssim"] if p["ssim"] is not None else 1.0, p["psnr"]))
    summary = dict(
        run_a=str(run_a),
        run_b=str(run_b),
        config_a=identity_a.get("config"),
        config_b=identity_b.get("config"),
        images=len(pairs),
        identical=len(pairs) - len(differing),
        mean_psnr=float(np.mean(finite)) if finite else math.inf,
        mean_ssim=None if pairs[0]["ssim"] is None else float(np.mean([p["ssim"] for p in pairs])),
        largest_difference=max(p["largest_difference"] for p in pairs),
        worst=[p["id"] for p in ranked[:WORST]],
        only_in_a=sorted(set(records_a) - set(records_b)),
        only_in_b=sorted(set(records_b) - set(records_a)),
    )
    if identity_a.get("model") == identity_b.get("model") == "digits" and pairs[0]["ssim"] is not None:
        summary["digit_accuracy"] = {
            "a": _digit_accuracy(run_a, [records_a[i] for i in shared]),
            "b": _digit_accuracy(run_b, [records_b[i] for i in shared]),
        }
    return dict(summary=summary, pairs=pairs)


def _digit_accuracy(folder, records: list[dict]) -> float | None:
    """The share of a digits run's images that the independent classifier reads as the digit their prompt asks
    for (prompts of the form "a handwritten 7"; None when no prompt has that form)."""
    from PIL import Image

    from .digits.classifier import digit_accuracy

    asked = [(r, DIGIT_PROMPT.fullmatch(r["prompt"].strip())) for r in records]
    asked = [(r, int(m.group(1))) for r, m in asked if m]
    if not asked:
        return None
    images = [Image.open(Path(folder) / r["file"]).convert("L") for r, _ in asked]
    return digit_accuracy(images, [digit for _, digit in asked])


def comparison_figure(comparison: dict):
    """compare.png's figure: histograms of PSNR and SSIM (images only). Identical images have an infinite PSNR,
    which no histogram shows: the PSNR panel counts them apart, and when every image is identical it says so in
    words instead of drawing an empty axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs, summary = comparison["pairs"], comparison["summary"]
    images, identical = summary["images"], summary["identical"]
    finite = [p["psnr"] for p in pairs if math.isfinite(p["psnr"])]
    psnr_name = "PSNR (dB)" if not (identical and finite) else f"PSNR (dB) of the {len(finite)} that differ"
    metrics = [(psnr_name, finite)]
    if summary["mean_ssim"] is not None:
        metrics.append(("SSIM", [p["ssim"] for p in pairs]))
    figure, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.2), squeeze=False)
    for axis, (name, values) in zip(axes[0], metrics):
        if values:
            axis.hist(values, bins=20, color="#4878a8")
            axis.set_ylabel("images")
        axis.set_xlabel(name)
    psnr_axis = axes[0][0]
    if not finite:  # nothing to draw: say why
        psnr_axis.set_xticks([])
        psnr_axis.set_yticks([])
        psnr_axis.text(
            0.5,
            0.5,
            f"all {images} images identical\n(PSNR ∞)",
            ha="center",
            va="center",
            transform=psnr_axis.transAxes,
            fontsize=12,
        )
    elif identical:
        psnr_axis.text(
            0.98,
            0.95,
            f"+ {identical} identical (PSNR ∞)",
            ha="right",
            va="top",
            transform=psnr_axis.transAxes,
            bbox=dict(facecolor="white", edgecolor="none", alpha=0.8),
        )
    figure.suptitle(f"{Path(summary['run_b']).name} against {Path(summary['run_a']).name}: {images} images")
    figure.tight_layout()
    return figure


def write_comparison(comparison: dict, output) -> Path:
    """compare.json and compare.png (comparison_figure) in `output`, each written atomically."""
    import matplotlib.pyplot as plt

    output = Path(output).expanduser()
    atomic_write(output / "compare.json", lambda p: p.write_text(json.dumps(comparison, indent=2)))
    figure = comparison_figure(comparison)
    atomic_write(output / "compare.png", lambda p: figure.savefig(p, format="png", dpi=100))
    plt.close(figure)
    return output


def format_summary(summary: dict) -> str:
    """The summary as the lines `xdit-lab compare` prints."""
    images, identical = summary["images"], summary["identical"]
    head = f"{summary['run_b']} against {summary['run_a']}: {images} images, {identical} identical"
    if identical == images:
        lines = [f"{head}: every image is the same in both runs (largest difference 0), none is worst"]
    else:
        ssim = "" if summary["mean_ssim"] is None else f", mean SSIM {summary['mean_ssim']:.4f}"
        of = f" (of the {images - identical} that differ)" if identical else ""
        lines = [
            f"{head}; mean PSNR{of} {summary['mean_psnr']:.2f} dB{ssim}, "
            f"largest difference {summary['largest_difference']:g}",
            f"worst: {', '.join(summary['worst'])}",
        ]
    if "digit_accuracy" in summary:
        accuracy = summary["digit_accuracy"]
        if None in (accuracy["a"], accuracy["b"]):  # prompts not of the form "a handwritten 7": nothing to read
            lines.append('the classifier is not asked: no prompt has the form "a handwritten N"')
        else:
            lines.append(
                f"the classifier reads the prompted digit in {accuracy['a']:.1%} of A and {accuracy['b']:.1%} of B"
            )
    for side in ("a", "b"):
        if summary[f"only_in_{side}"]:
            lines.append(f"only in {side.upper()}: {len(summary[f'only_in_{side}'])} images (not compared)")
    return "\n".join(lines)
