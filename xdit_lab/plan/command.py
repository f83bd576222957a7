"""`xdit-lab plan --model FOLDER --world-size N --gpu-memory 24GB`: the plan printed as a table (or a
JSON list), and when nothing fits, the smallest GPU that would and for which configuration."""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..model_folder import ModelFolderError
from ..plan_table import why_lines, wrapped
from .rows import GB, plan_model, smallest_fit
from .table import fit_ranking_reasons, format_rows, model_legend, weights_word

MEMORY_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
MEMORY_UNITS.update(KIB=2**10, MIB=2**20, GIB=2**30, TIB=2**40)


def memory_size(text: str) -> int:
    """argparse type for one GPU's memory: '24GB' (10^9 bytes), '22.5GiB' (2^30) or a byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in MEMORY_UNITS or (not unit and "." in match.group(1)):
        raise argparse.ArgumentTypeError(
            f"expected a memory size such as 24GB (10^9 bytes), 22.5GiB (2^30 bytes) or a byte count "
            f"(24000000000); units: KB, MB, GB, TB, KiB, MiB, GiB, TiB; got {text!r}"
        )
    size = int(float(match.group(1)) * MEMORY_UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"the GPU memory must be at least one byte, got {text!r}")
    return size


def print_plan(
    folder,
    world_size: int,
    gpu_memory: int,
    dtype,
    as_json: bool,
    top: int,
    request: dict,
    *,
    wide: bool = False,
    why: bool = False,
) -> int:
    """Plan `folder` for `world_size` GPUs of `gpu_memory` bytes and print it: the request, the table
    (`wide`: every term of a rank's total, a column each), what each column means, the planner's notes
    and, with `why`, why each row ranks above the next; every line but the wide table's within 100
    columns. 2 (and the error on stderr) when the folder or the request is wrong."""
    try:
        rows = plan_model(folder, world_size, gpu_memory, dtype=dtype, **request)
    except (ModelFolderError, ValueError, OSError) as error:  # the user's input: say what is wrong, no traceback
        print(f"xdit-lab plan: error: {error}", file=sys.stderr)
        return 2
    shown = rows[: top or None]
    reasons = fit_ranking_reasons(rows)[: len(shown)] if why else []
    if as_json:
        found = [row.to_json() for row in shown]
        for row, reason in zip(found, reasons):
            row["why_above_the_next"] = reason
        print(json.dumps(found, indent=1))
    else:
        planned = rows[0].request
        print(wrapped(f"{planned.describe()}; {world_size} GPU(s) of {gpu_memory / GB:.3g} GB each"))
        print(format_rows(rows, top, wide=wide))
        if len(rows) > top > 0:
            print(f"... {len(rows) - top} more (--top 0 shows all {len(rows)})")
        print(model_legend(shown, wide))
        for note in dict.fromkeys([*planned.notes, *rows[0].unknown]):
            print(wrapped(f"note: {note}"))
        if why:
            print(why_lines([f"#{i}" for i in range(1, len(shown) + 1)], reasons))
    if not any(row.fits for row in rows):
        best = smallest_fit(rows)
        print(
            wrapped(
                f"nothing fits {world_size} × {gpu_memory / GB:.3g} GB: the smallest GPU that would is "
                f"{best.per_rank_bytes / GB:.2f} GB, under {best.config.short()} with "
                f"{weights_word(best)} weights and text encoders {best.text_encoders}"
            ),
            file=sys.stderr if as_json else sys.stdout,
        )
    return 0
