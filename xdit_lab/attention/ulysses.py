"""Ulysses attention: trade sequence shards for head shards with two all-to-alls.

Each of the N ranks of a Ulysses group holds a chunk of the sequence with all H heads. An
all-to-all gives every rank the whole (group's) sequence for H/N heads, attention runs there
unsplit, and a second all-to-all gives each rank its sequence chunk back with all heads:

    q[B, H, S/N, D] --all-to-all--> q[B, H/N, S, D] --attention--> o[B, H/N, S, D]
                    --all-to-all--> o[B, H, S/N, D]

q, k, v and o each cross the network once; (N-1)/N of each leaves the rank. q, k and v share
the first all-to-all, o the second: two collectives per attention. Shards may have unequal
lengths (S not divisible by N): the all-to-all moves them as they are, nothing padded. Joint
text tokens are whole on every rank, so their heads are simply sliced locally; their output
rides in the second all-to-all, which gathers it over heads.
"""

from __future__ import annotations

import itertools

import torch

from .. import comm
from ..mesh import ULYSSES


def seq_to_heads(xs, mesh, seq_sizes: list[int], *, tag: str = "") -> list[torch.Tensor]:
    """Each x[B, H, S_me, D] of `xs` (one shape) -> x[B, H/N, S, D]: scatter heads, gather the
    sequence. All of `xs` (q, k and v) travel in one all-to-all; each is copied once into the
    send buffer and once out of the receive buffer."""
    batch, heads, local, head_dim = xs[0].shape
    n, m = len(seq_sizes), len(xs)
    per_rank = heads // n
    send = xs[0].new_empty((n, m, batch, per_rank, local, head_dim))  # [to rank j][tensor i]
    for i, x in enumerate(xs):
        send[:, i].copy_(x.view(batch, n, per_rank, local, head_dim).transpose(0, 1))
    piece = m * batch * per_rank * head_dim  # elements per token
    recv_sizes = [s * piece for s in seq_sizes]
    received = comm.all_to_all(send.view(-1), [local * piece] * n, recv_sizes, mesh, ULYSSES, tag=tag)
    out = send.new_empty((m, batch, per_rank, sum(seq_sizes), head_dim))
    for part, start, size in zip(received.split(recv_sizes), _starts(seq_sizes), seq_sizes):
        out[:, :, :, start : start + size].copy_(part.view(m, batch, per_rank, size, head_dim))
    return list(out.unbind(0))


def heads_to_seq(x: torch.Tensor, mesh, seq_sizes: list[int], *, joint=None, tag: str = ""):
    """x[B, H/N, S, D] -> x[B, H, S_me, D]: scatter the sequence, gather heads. `joint`, the text
    output [B, H/N, T, D] whole on every rank, rides in the same all-to-all (a copy to every
    peer) and comes back with all heads. Returns (out, joint_out or None)."""
    batch, per_rank, _, head_dim = x.shape
    n, me = len(seq_sizes), mesh.group_rank(ULYSSES)
    text = 0 if joint is None else joint.shape[2]
    row = batch * per_rank * head_dim  # elements per token of one rank's heads
    send_sizes = [(s + text) * row for s in seq_sizes]
    send = x.new_empty(sum(send_sizes))
    for part, start, size in zip(send.split(send_sizes), _starts(seq_sizes), seq_sizes):
        part[: size * row].view(batch, per_rank, size, head_dim).copy_(x[:, :, start : start + size])
        if text:
            part[size * row :].view(batch, per_rank, text, head_dim).copy_(joint)
    mine = seq_sizes[me]
    received = comm.all_to_all(send, send_sizes, [(mine + text) * row] * n, mesh, ULYSSES, tag=tag)
    out = x.new_empty((batch, n * per_rank, mine, head_dim))
    joint_out = None if joint is None else joint.new_empty((batch, n * per_rank, text, head_dim))
    for source, part in enumerate(received.split((mine + text) * row)):
        heads = slice(source * per_rank, (source + 1) * per_rank)
        out[:, heads].copy_(part[: mine * row].view(batch, per_rank, mine, head_dim))
        if text:
            joint_out[:, heads].copy_(part[mine * row :].view(batch, per_rank, text, head_dim))
    return out, joint_out


def _starts(sizes: list[int]) -> list[int]:
    """Where each rank's tokens begin in the gathered sequence."""
    return [0, *itertools.accumulate(sizes)][:-1]


def ulysses_attention(q, k, v, mesh, seq_sizes: list[int], inner, *, joint=None, joint_mask=None, scale=None):
    """Attention over the Ulysses group's whole sequence, computed on H/N heads per rank.

    seq_sizes: every group rank's local sequence length, in group order. `inner(q, k, v,
    joint=..., joint_mask=..., scale=...)` computes attention on the gathered tensors and returns
    (out, joint_out); it is local attention, or Ring attention when Ulysses runs inside Ring. A
    text key mask is per sample, the same for every head: it goes to `inner` as it is."""
    n = len(seq_sizes)
    me = mesh.group_rank(ULYSSES)
    per_rank = q.shape[1] // n
    q, k, v = seq_to_heads((q, k, v), mesh, seq_sizes, tag="qkv")
    if joint is not None:  # replicated text: every rank already has every head
        joint = tuple(t.narrow(1, me * per_rank, per_rank) for t in joint)
    out, joint_out = inner(q, k, v, joint=joint, joint_mask=joint_mask, scale=scale)
    return heads_to_seq(out, mesh, seq_sizes, joint=joint_out, tag="out")
