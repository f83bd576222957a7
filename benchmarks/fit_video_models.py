"""The best configuration that fits each GPU set for the real video models, at 480p and 720p, decode included.

    python benchmarks/fit_video_models.py [--models Wan2.1-T2V-14B ...] [--gpus 1 2 4 8] [--memory 24GB 80GB]
                                          [--frames 81] [--folders DIR]

Each model's folder is rebuilt from its published configs (xdit_lab.real_models.save_header_only: every
safetensors header, the data a sparse hole) and planned by xdit_lab.plan.plan_model for N GPUs of each memory
in bfloat16, at 832 × 480 and 1280 × 720 pixels (each side rounded down to what the model draws: LTX-2's to a
multiple of 32, 704 × 1280, said in the size column) and `--frames` frames (81: five seconds at 16 fps; LTX-2 at
its pipeline's 121, FRAMES, unless `--frames` is given). Printed as a markdown table: per model, size and GPU set,
the best row that fits (ranked by the cost model: work, then bytes sent per step with FSDP2's gathers) and its
terms per rank, the VAE decode's peak among them (the video VAE's closed form, whole or the largest row band:
plan.wan_decode_peak_bytes, cogvideox_decode_peak_bytes, hunyuan_decode_peak_bytes, hunyuan15_decode_peak_bytes,
ltx2_decode_peak_bytes; "?" where the planner has none for the VAE, said in the notes); where nothing fits, the
smallest row. Nothing here reads a weight: the figures are the plan's, not a measurement.
"""

import argparse
import tempfile
from pathlib import Path

from xdit_lab.model_folder import read_model_folder
from xdit_lab.plan import GB, plan_model
from xdit_lab.plan.command import memory_size
from xdit_lab.real_models import REAL_MODELS, save_header_only

DEFAULT_MODELS = [
    "Wan2.1-T2V-14B",
    "Wan2.2-T2V-A14B",
    "HunyuanVideo",
    "CogVideoX-5b",
    "HunyuanVideo-1.5-720p_t2v",
    "LTX-2",
]
SIZES = {"480p": (480, 832), "720p": (720, 1280)}  # (height, width)
FRAMES = {"LTX-2": 121}  # the pipeline's own default where it is not 81 (LTX2Pipeline: 5 seconds at 24 fps, + 1)


def _gb(n) -> str:
    return "?" if n is None else f"{n / GB:.2f}"


def row_cells(row) -> list[str]:
    """The row's name and its terms per rank, GB: weights (every component), gather, latents and conditioning,
    stale K/V, decode peak, the total."""
    return [
        f"{row.name()}, text encoders {row.text_encoders}",
        _gb(sum(row.weights.values())),
        _gb(row.gather),
        _gb(row.latents + row.conditioning),
        _gb(row.stale_kv),
        _gb(row.decode_peak),
        _gb(row.per_rank_bytes),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(REAL_MODELS))
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--memory", type=memory_size, nargs="+", default=[24 * GB, 80 * GB])
    parser.add_argument("--frames", type=int, help="frames of every video (default: 81, or FRAMES' for the model)")
    parser.add_argument("--folders", type=Path, help="where to build the folders (default: a temporary one)")
    args = parser.parse_args()
    notes = set()
    with tempfile.TemporaryDirectory() as temporary:
        root = args.folders or Path(temporary)
        print(
            "| model | size | GPUs | best that fits (or the smallest row) | weights | gather | latents+cond | "
            "stale K/V | decode peak | GB per rank |"
        )
        print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name in args.models:
            folder = save_header_only(name, root / name.replace("Σ", "S"))
            frames = args.frames or FRAMES.get(name, 81)
            model = read_model_folder(folder)
            multiple = model.recipe.planned_multiple(model.configs)
            for size, (height, width) in SIZES.items():
                height, width = height // multiple * multiple, width // multiple * multiple
                if (height, width) != SIZES[size]:
                    size = f"{size} ({height} × {width})"
                for gpus in args.gpus:
                    for memory in args.memory:
                        rows = plan_model(
                            folder, gpus, memory, height=height, width=width, options={"num_frames": frames}
                        )
                        fitting = [row for row in rows if row.fits]
                        row = fitting[0] if fitting else min(rows, key=lambda r: r.per_rank_bytes)
                        cells = row_cells(row)
                        if not fitting:
                            cells[0] = f"nothing fits (smallest: {cells[0]})"
                        notes.update(f"{name}: {note}" for note in (*row.unknown, *row.bounds))
                        print(f"| {name} | {size} | {gpus} × {memory / GB:.0f} GB | " + " | ".join(cells) + " |")
    for note in sorted(notes):
        print(f"\nnote: {note}")


if __name__ == "__main__":
    main()
