"""FP8 on the wire: what sequence parallelism's exchanges carry when `ParallelConfig.comm_dtype` is set.

Ulysses' two all-to-alls (q, k, v in; o out) and Ring's K/V blocks move activations whose last dimension
is a head's head_dim D. Each row of D elements (one token of one head) travels as D float8 bytes and
its own float32 scale (4 bytes, amax / the format's largest finite value), packed side by side in one
uint8 buffer, one collective as before:

    x[rows, D] (model dtype) --pack--> [rows, D + 4] uint8 --all-to-all / send--> --unpack--> x[rows, D]

Why a scale per row (token × head): activations have outlier tokens, and a token's heads differ in
range; a scale per (peer, head) block over all its tokens would let one outlier token flatten the
others into float8's subnormals. The price is 4/D of the float8 bytes (3% at D = 128; the tiny test
models' D is 16, so the scales weigh more there). A row keeps e4m3's 3 mantissa bits: an element is off by
at most half an ulp, 2^-4 of itself, or 2^-10 of the scale where it falls among the subnormals (below 2^-6
of the scale). The bytes: D + 4 per row instead of D·e (xdit_lab/traffic.py counts them).

The buffers travel as uint8 (gloo has no float8; NCCL moves the bytes as they are), so the receive
buffer is uint8 whatever the model's dtype, and unpacking writes the model's dtype. What a rank keeps
of its own all-to-all chunk never travels: it is copied back exact. Ring forwards the packed block it
received, not a requantized one: a block is rounded once, however many hops it makes.

`Wire.wrong_scales` is the control (Controls.wrong_comm_scales): each row is unpacked with the scale of
the row before it (the neighbouring head's or token's), the mistake per-row scales must not make.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import comm
from ..config import SCALE_BYTES  # one float32 scale per row of head_dim elements


@dataclasses.dataclass(frozen=True)
class Wire:
    dtype: torch.dtype  # the float8 format on the wire
    wrong_scales: bool = False  # the control: unpack each row with its neighbour's scale

    @staticmethod
    def of(comm_dtype: str | None, wrong_scales: bool = False) -> Wire | None:
        """The wire for ParallelConfig.comm_dtype (None: the model's dtype travels, no Wire)."""
        return None if comm_dtype is None else Wire(getattr(torch, comm_dtype), wrong_scales)

    def packed_size(self, elements: int, row: int) -> int:
        """Bytes that `elements` (whole rows of `row`) take on the wire."""
        return elements // row * (row + SCALE_BYTES)

    def pack(self, x: torch.Tensor, row: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x (contiguous, whole rows of `row` elements) -> flat uint8 [rows·(row + 4)]: each row's float8
        bytes, then its float32 scale's bytes."""
        rows = x.view(-1, row)
        largest = torch.finfo(self.dtype).max
        scale = rows.abs().amax(dim=1, keepdim=True).float() / largest
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, 1
        packed = (
            out.view(-1, row + SCALE_BYTES)
            if out is not None
            else x.new_empty((rows.shape[0], row + SCALE_BYTES), dtype=torch.uint8)
        )
        packed[:, :row].view(self.dtype).copy_(rows.float() / scale)  # rounds to the nearest float8
        packed[:, row:].view(torch.float32).copy_(scale)
        return packed.view(-1)

    def unpack(
        self, packed: torch.Tensor, row: int, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """pack's inverse into `dtype` (written into `out`, flat, when given)."""
        rows = packed.view(-1, row + SCALE_BYTES)
        scale = rows[:, row:].view(torch.float32)
        if self.wrong_scales:
            scale = scale.roll(1, dims=0)
        values = rows[:, :row].view(self.dtype).float() * scale
        if out is None:
            return values.to(dtype).view(-1)
        out.view(-1, row).copy_(values)
        return out


def all_to_all(send, send_sizes, recv_sizes, mesh, group, *, row: int, wire: Wire | None, tag: str = ""):
    """comm.all_to_all of `send` (flat, whole rows of `row` elements per peer), in float8 when `wire` is
    given: packed, exchanged as uint8, unpacked into send's dtype. This rank's own chunk comes back exact."""
    if wire is None or mesh.group_size(group) == 1:
        return comm.all_to_all(send, send_sizes, recv_sizes, mesh, group, tag=tag)
    packed = wire.pack(send, row)
    received = comm.all_to_all(
        packed,
        [wire.packed_size(n, row) for n in send_sizes],
        [wire.packed_size(n, row) for n in recv_sizes],
        mesh,
        group,
        tag=tag,
    )
    out = wire.unpack(received, row, send.dtype)
    me = mesh.group_rank(group)
    start, own = sum(send_sizes[:me]), send_sizes[me]
    out[sum(recv_sizes[:me]) :][:own].copy_(send[start : start + own])  # what stayed here, unrounded
    return out
