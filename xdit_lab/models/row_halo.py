"""A convolution over token rows, under sequence shards: each rank convolves its band of rows with the
rows just outside it, sent by its neighbours (a halo), the way vae.py's bands do (adapter.RowConvolution:
Sana's feed-forward, GLUMBConv, lays the tokens out [B, C, H, W] and runs a 3×3 depthwise convolution).

Every rank's shard must be whole rows (the token strategy refuses another cut by name). Then:

    each block of the list, told height=H:   height -> this rank's rows h        strategy.token_rows(H, W)
    the convolving module, x[B, C, h, W]:    [B, C, t + h + u, W]           strategy.halo(name, x, reach)
        t = u = `reach` rows from the rank above and the rank below (none at the image's top and bottom,
        where the convolution's own zero padding stands, as in the whole image)
    its output [B, C, t + h + u, W]:         its rows t .. t + h, this rank's band

Exact: inside the module only 1 × 1 convolutions and elementwise steps sit around the 3 × 3 one, so the
halo's rows give the band's edge rows what the whole image gives them. Under torch.compile the exchange is
one opaque operator (xdit_lab::halo), recorded as in eager.
"""

from __future__ import annotations

import inspect
import re

import torch

from .. import comm


def install_row_convolution(transformer, state) -> None:
    """The block hooks ("rows[<block>]") and the convolving modules' forwards ("halo[<module>]") of the
    adapter's RowConvolution."""
    rows = state.adapter.row_convolution
    for name, module in transformer.named_modules():
        if re.search(rows.blocks, name):
            _hook_block_rows(module, name, state, rows)
        elif re.search(rows.module, name):
            _halo_forward(module, name, state, rows.reach)


def _hook_block_rows(block, name: str, state, rows) -> None:
    """The block's `height` argument becomes this rank's rows (its `width` stays the image's)."""
    parameters = list(inspect.signature(type(block).forward).parameters)[1:]  # without self
    height_at, width_at = parameters.index(rows.height), parameters.index(rows.width)

    def argument(args, kwargs, name, position):
        return kwargs[name] if name in kwargs else args[position]

    def local_rows(_module, args, kwargs):
        if not state.in_forward:
            return None
        height = argument(args, kwargs, rows.height, height_at)
        mine = state.strategy.token_rows(height, argument(args, kwargs, rows.width, width_at))
        if rows.height in kwargs:
            kwargs[rows.height] = mine
        else:
            args = (*args[:height_at], mine, *args[height_at + 1 :])
        return args, kwargs

    state.hooks.forward_pre_hook(f"rows[{name}]", block, local_rows, with_kwargs=True)


def _halo_forward(module, name: str, state, reach: int) -> None:
    own = type(module).forward

    def forward(x):
        if not state.in_forward:
            return own(module, x)
        top, bottom = state.strategy.halo_sizes(reach)
        if torch.compiler.is_compiling():
            extended = torch.ops.xdit_lab.halo(x, state.handle, name, reach)
        else:
            extended = state.strategy.halo(name, x, reach)
        out = own(module, extended)
        return out[:, :, top : out.shape[2] - bottom]

    state.hooks.replace(f"halo[{name}]", module, forward=forward)


def exchange_halo(x: torch.Tensor, mesh, group: str, reach: int) -> torch.Tensor:
    """x[B, C, h, W], this group rank's band: [B, C, t + h + u, W] with `reach` rows of the previous group
    rank's band above it and of the next one's below (t = 0 on the first rank, u = 0 on the last); this
    band's own edge rows go to them in the same exchange."""
    me, ranks = mesh.group_rank(group), mesh.group_ranks(group)
    above = x.new_empty((*x.shape[:2], reach, x.shape[3])) if me > 0 else None
    below = x.new_empty((*x.shape[:2], reach, x.shape[3])) if me < len(ranks) - 1 else None
    sends, receives = [], []
    if above is not None:
        sends.append((x[:, :, :reach], ranks[me - 1]))
        receives.append((above, ranks[me - 1]))
    if below is not None:
        sends.append((x[:, :, -reach:], ranks[me + 1]))
        receives.append((below, ranks[me + 1]))
    comm.wait(comm.exchange(sends, receives, mesh, group, tag="halo"))
    return torch.cat([t for t in (above, x, below) if t is not None], dim=2)


@torch.library.custom_op("xdit_lab::halo", mutates_args=())
def _halo_op(x: torch.Tensor, state: int, name: str, reach: int) -> torch.Tensor:
    return comm.from_handle(state).strategy.halo(name, x, reach)


@_halo_op.register_fake
def _(x, state, name, reach):
    top, bottom = comm.from_handle(state).strategy.halo_sizes(reach)
    return x.new_empty((*x.shape[:2], x.shape[2] + top + bottom, x.shape[3]))
