"""Measured against a reference: latents against the serial run, bytes against the closed forms.
(The controls that show a measured bound can fail are in xdit_lab.lessons.controls.)

Pure functions over what a run hands back (latents, rank summaries from summaries.py). The
tables are text with integers or rounded figures, so a notebook can print them in a checked cell.

    compare_to_serial(latents, serial)   max relative difference and relative L2
    comm_table(summaries)                bytes out of each rank per group: measured beside the formula
    bytes_match(summaries)               measured == formula on every rank, step and group
    PeakTensorBytes()                    the peak bytes of the tensors a block creates (CPU too)
"""

from __future__ import annotations

import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .table import text_table
from .views import GROUP_ORDER, role


def compare_to_serial(parallel, serial) -> dict:
    """How far `parallel` is from `serial` (same shape): max |a - b| / max |b| (the exact strategies'
    check, within 1e-4 in float32) and ||a - b|| / ||b|| (relative L2), in float64 on the CPU
    (a GPU engine's latents and the notebook's serial ones may sit on different devices)."""
    parallel, serial = (torch.as_tensor(x).detach().to("cpu", torch.float64) for x in (parallel, serial))
    if parallel.shape != serial.shape:
        raise ValueError(f"parallel {tuple(parallel.shape)} and serial {tuple(serial.shape)} differ in shape")
    difference = parallel - serial
    return dict(
        max_relative=(difference.abs().max() / serial.abs().max().clamp_min(1e-30)).item(),
        relative_l2=(difference.norm() / serial.norm().clamp_min(1e-30)).item(),
    )


def max_relative_difference(parallel, serial) -> float:
    return compare_to_serial(parallel, serial)["max_relative"]


def deviation_text(value: float, floor: float = 1e-5) -> str:
    """A deviation as a lesson prints it: '< 1e-5' under `floor`, a power of ten (float32 rounding
    there, whose digits vary by machine), else two significant figures ('2.3e-03')."""
    return f"< 1e{round(math.log10(floor))}" if value < floor else significant(value)


def significant(value: float, digits: int = 2) -> str:
    """`value` to `digits` significant figures in scientific notation ('3.1e-02'): a fixed width,
    and rounding that hides the last-bit differences between machines."""
    return f"{value:.{digits - 1}e}"


def comm_rows(summaries, step: int = -1) -> list[dict]:
    """Bytes out of each rank in one step (default: the last), per group: measured (comm_log) and
    the closed form (expected_bytes_per_step), one dict per (rank, group) that moved anything."""
    rows = []
    for s in sorted((s for s in summaries if s is not None), key=lambda s: s["rank"]):
        if not s["comm"]["measured"]:
            continue
        measured, expected = s["comm"]["measured"][step], s["comm"]["expected"][step]
        for group in GROUP_ORDER:
            if measured.get(group) or expected.get(group):
                rows.append(
                    dict(
                        rank=s["rank"],
                        role=role(s),
                        group=group,
                        measured=measured.get(group, 0),
                        formula=expected.get(group, 0),
                    )
                )
    return rows


def comm_table(summaries, step: int = -1) -> str:
    """comm_rows as aligned text, with a column saying whether measurement and formula agree."""
    rows = comm_rows(summaries, step)
    if not rows:
        return "no bytes moved in this step"
    return text_table(
        ("rank", "role", "group", "measured B", "formula B", "equal"),
        [
            [
                str(r["rank"]),
                r["role"],
                r["group"],
                f"{r['measured']:,}",
                f"{r['formula']:,}",
                str(r["measured"] == r["formula"]),
            ]
            for r in rows
        ],
    )


def bytes_match(summaries) -> bool:
    """Measured bytes equal the closed form on every rank, every step and every group."""
    found = [s for s in summaries if s is not None]
    return bool(found) and all(s["comm"]["measured"] == s["comm"]["expected"] and s["comm"]["measured"] for s in found)


# ---- memory: the peak of the tensors a block of code creates ------------------------------------------


class PeakTensorBytes(TorchDispatchMode):
    """`with PeakTensorBytes() as m: ...`, then `m.peak`: the most bytes that tensors created inside
    the block held at once (each storage counted once, released when the last tensor made inside
    that shows it is freed). Works on CPU, where no allocator keeps a peak; tensors made before the
    block (weights, inputs) are not counted."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._users: dict[int, list[int]] = {}  # storage id -> [tensors alive, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                key = value.untyped_storage().data_ptr()
                if key not in self._users:
                    nbytes = value.untyped_storage().nbytes()
                    self._users[key] = [0, nbytes]
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self._users[key][0] += 1
                weakref.finalize(value, self._release, key)
        return out

    def _release(self, key: int) -> None:
        users = self._users.get(key)
        if users is None:
            return
        users[0] -= 1
        if users[0] == 0:
            self.live -= users[1]
            del self._users[key]
