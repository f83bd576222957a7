"""The best configuration that fits each GPU set, for real models planned from header-only folders.

    python benchmarks/fit_real_models.py [--models FLUX.1-dev Wan2.1-T2V-14B] [--gpus 2 4 8]
                                         [--memory 24GB 80GB] [--folders DIR]

Each model's folder is rebuilt from its published configs (xdit_lab.real_models.save_header_only:
every safetensors header, the data a sparse hole, a few hundred KB on disk) and planned by
xdit_lab.plan.plan_model for N GPUs of each memory, at the model's default size in bfloat16. Printed
as a markdown table: per model and GPU set, the best row that fits (ranked by the cost model:
work, then bytes sent per step with FSDP2's gathers) and its GB per rank; the best that fits without
PipeFusion (exact: sequence parallelism, cfg and dp read no stale K/V); and the replicated row of
the first one's degrees (everything whole on every GPU, what xdit_lab runs today) for reference.
Nothing here reads a weight: the figures are the plan's, not a measurement.
"""

import argparse
import tempfile
from pathlib import Path

from xdit_lab.plan import GB, plan_model
from xdit_lab.plan.command import memory_size
from xdit_lab.real_models import REAL_MODELS, save_header_only

DEFAULT_MODELS = ["FLUX.1-dev", "SD3.5-large", "Wan2.1-T2V-14B", "CogVideoX-5b"]


def best_rows(folder: Path, gpus: int, memory: int):
    """(the best fitting row, the best fitting row without PipeFusion (exact: no stale K/V), the
    replicated row of the first one's degrees, the smallest row); a best is None when nothing fits."""
    rows = plan_model(folder, gpus, memory)
    fitting = [row for row in rows if row.fits]
    best = fitting[0] if fitting else None
    exact = next((row for row in fitting if row.config.pipefusion == 1), None)
    smallest = min(rows, key=lambda row: row.per_rank_bytes)
    shown = best or smallest
    replicated = next(
        row for row in rows if row.config == shown.config and not row.shard_weights and row.text_encoders == "gpu"
    )
    return best, exact, replicated, smallest


def _named(row) -> str:
    return f"{row.name()}, text encoders {row.text_encoders}, {row.per_rank_bytes / GB:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(REAL_MODELS))
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--memory", type=memory_size, nargs="+", default=[24 * GB, 80 * GB])
    parser.add_argument("--folders", type=Path, help="where to build the folders (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        root = args.folders or Path(temporary)
        print("| model | GPUs | best that fits, GB per rank | best without PipeFusion, GB per rank | replicated GB |")
        print("| --- | --- | --- | --- | ---: |")
        for name in args.models:
            folder = save_header_only(name, root / name.replace("Σ", "S"))
            for gpus in args.gpus:
                for memory in args.memory:
                    best, exact, replicated, smallest = best_rows(folder, gpus, memory)
                    first = _named(best) if best else f"nothing (smallest: {_named(smallest)})"
                    second = _named(exact) if exact else "nothing"
                    print(
                        f"| {name} | {gpus} × {memory / GB:.0f} GB | {first} | {second} | "
                        f"{replicated.per_rank_bytes / GB:.2f} |"
                    )
        unknown = sorted({note for name in args.models for note in _notes(root, name)})
        for note in unknown:
            print(f"\nnote: {note}")


def _notes(root: Path, name: str):
    rows = plan_model(root / name.replace("Σ", "S"), 2, 80 * GB)
    return [*rows[0].unknown, *rows[0].bounds]


if __name__ == "__main__":
    main()
