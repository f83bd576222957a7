"""`xdit-lab compare RUN_A RUN_B`: two runs' images matched by id, each pair's PSNR, SSIM and largest difference,
and for the digits model each run's classifier accuracy. The run folders are written here as `xdit-lab run
--prompts` writes them (run.json, records.jsonl, one PNG per image), with images whose distances have a closed
form; tests/test_prompts_file_runs.py compares two real runs with the command itself."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from xdit_lab.compare import CompareError, compare_runs, comparison_figure, format_summary, write_comparison
from xdit_lab.digits.components import load_digit_images, prompt_for
from xdit_lab.output_folder import append_record, open_run


def _write_run(folder, images: dict[str, np.ndarray], prompts: dict[str, str] | None = None, model="digits"):
    open_run(folder, dict(model=model, steps=4))
    for image_id, pixels in images.items():
        Image.fromarray(pixels).save(folder / f"{image_id}.png")
        append_record(folder, dict(id=image_id, prompt=(prompts or {}).get(image_id, "a cat"), file=f"{image_id}.png"))
    return folder


def test_distances_have_their_closed_forms_and_the_worst_come_first(tmp_path):
    rng = np.random.default_rng(0)
    base = {f"{i:05d}-0": rng.integers(20, 200, size=(16, 16, 3), dtype=np.uint8) for i in range(8)}
    shifted = dict(base)
    shifted["00001-0"] = base["00001-0"] + 10  # every pixel 10 levels up: PSNR 20 log10(255 / 10)
    noisy = base["00002-0"].astype(int) + rng.integers(-40, 41, size=(16, 16, 3))
    shifted["00002-0"] = noisy.clip(0, 255).astype(np.uint8)
    del shifted["00007-0"]
    a = _write_run(tmp_path / "a", base, model="pixart")
    b = _write_run(tmp_path / "b", shifted, model="pixart")

    comparison = compare_runs(a, b)
    pairs = {p["id"]: p for p in comparison["pairs"]}
    assert pairs["00001-0"]["psnr"] == pytest.approx(20 * math.log10(255 / 10), abs=1e-9)
    assert pairs["00001-0"]["largest_difference"] == 10
    assert pairs["00000-0"]["psnr"] == math.inf and pairs["00000-0"]["ssim"] == pytest.approx(1.0)
    summary = comparison["summary"]
    assert (summary["images"], summary["identical"], summary["only_in_a"]) == (7, 5, ["00007-0"])
    assert summary["worst"][:2] == ["00002-0", "00001-0"]  # the noisy one has the lowest SSIM
    assert pairs["00002-0"]["ssim"] < pairs["00001-0"]["ssim"] < 1
    assert "digit_accuracy" not in summary  # not the digits model

    with pytest.raises(CompareError, match="holds no run.json and records.jsonl"):
        compare_runs(a, tmp_path)


def test_the_digits_classifier_reads_each_run_and_the_command_writes_its_files(tmp_path):
    """Real digits (the model's training images) under their own prompts in A, under the next digit's in B: the
    classifier reads A as prompted and B not; `xdit-lab compare` prints it and writes compare.json and .png."""
    images, labels = load_digit_images()
    pixels = ((images[:20].permute(0, 2, 3, 1) + 1) * 127.5).round().clamp(0, 255).numpy().astype(np.uint8)
    pictures = {f"{i:05d}-0": pixels[i] for i in range(20)}
    own = {image_id: prompt_for(int(labels[i])) for i, image_id in enumerate(pictures)}
    next_digit = {image_id: prompt_for((int(labels[i]) + 1) % 10) for i, image_id in enumerate(pictures)}
    a = _write_run(tmp_path / "a", pictures, own)
    b = _write_run(tmp_path / "b", pictures, next_digit)

    result = subprocess.run(
        [sys.executable, "-m", "xdit_lab.cli", "compare", str(a), str(b)], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((b / "compare" / "compare.json").read_text())["summary"]
    assert summary["digit_accuracy"]["a"] >= 0.9 and summary["digit_accuracy"]["b"] <= 0.2, summary
    assert summary["identical"] == 20
    assert Image.open(b / "compare" / "compare.png").size[0] > 100
    assert f"the classifier reads the prompted digit in {summary['digit_accuracy']['a']:.1%} of A" in result.stdout


def _psnr_panel_texts(comparison):
    from matplotlib import pyplot as plt

    figure = comparison_figure(comparison)
    try:
        psnr = figure.axes[0]
        return [t.get_text() for t in psnr.texts], len(psnr.patches), psnr.get_xlabel()
    finally:
        plt.close(figure)


def test_identical_runs_name_no_worst_image_and_say_so_in_the_plot(tmp_path):
    """Two identical runs: no image is "worst", the summary says all are identical, and the PSNR panel (no finite
    PSNR to draw) says so in words. The control, one image changed, names that one alone and draws its PSNR."""
    rng = np.random.default_rng(1)
    base = {f"{i:05d}-0": rng.integers(20, 200, size=(16, 16, 3), dtype=np.uint8) for i in range(3)}
    same = compare_runs(_write_run(tmp_path / "a", base, model="pixart"), _write_run(tmp_path / "b", base))
    assert same["summary"]["worst"] == [] and same["summary"]["identical"] == 3
    printed = format_summary(same["summary"])
    assert "worst:" not in printed and "3 images, 3 identical" in printed and "none is worst" in printed, printed
    texts, bars, _ = _psnr_panel_texts(same)
    assert texts == ["all 3 images identical\n(PSNR ∞)"] and bars == 0

    changed = dict(base, **{"00001-0": base["00001-0"] + 10})
    one = compare_runs(tmp_path / "a", _write_run(tmp_path / "c", changed, model="pixart"))
    assert one["summary"]["worst"] == ["00001-0"] and one["summary"]["identical"] == 2
    assert "worst: 00001-0\n" in format_summary(one["summary"]) + "\n"
    texts, bars, label = _psnr_panel_texts(one)
    assert texts == ["+ 2 identical (PSNR ∞)"] and bars > 0 and "of the 1 that differ" in label
    write_comparison(same, tmp_path / "out")  # the figure saves (∞ is in the font)
    assert Image.open(tmp_path / "out" / "compare.png").size[0] > 100


def test_a_digits_run_whose_prompts_name_no_digit_prints_its_summary(tmp_path):
    """The digits model under free prompts ("a cat"): the classifier has nothing to check, and the summary says so
    (it raised a TypeError formatting None as a percentage)."""
    rng = np.random.default_rng(2)
    base = {f"{i:05d}-0": rng.integers(20, 200, size=(16, 16, 3), dtype=np.uint8) for i in range(2)}
    comparison = compare_runs(_write_run(tmp_path / "a", base), _write_run(tmp_path / "b", base))
    assert comparison["summary"]["digit_accuracy"] == {"a": None, "b": None}
    assert 'no prompt has the form "a handwritten N"' in format_summary(comparison["summary"])
