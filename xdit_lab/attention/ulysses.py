"""Ulysses attention: trade sequence shards for head shards with two all-to-alls.

Each of the N ranks of a Ulysses group holds a chunk of the sequence with all H heads. An
all-to-all gives every rank the whole (group's) sequence for H/N heads, attention runs there
unsplit, and a second all-to-all gives each rank its sequence chunk back with all heads:

    q[B, H, S/N, D] --all-to-all--> q[B, H/N, S, D] --attention--> o[B, H/N, S, D]
                    --all-to-all--> o[B, H, S/N, D]

q, k, v and o each cross the network once; (N-1)/N of each leaves the rank. q, k and v share
the first all-to-all, o the second: two collectives per attention. Shards may have unequal
lengths (S not divisible by N): the all-to-all moves them as they are, nothing padded.

What travels is token-major, [B, tokens, H/N, D] per peer (q, k, v side by side on the way in),
the layout the model's projections write and read. Packing a tensor for every peer is one
permute-copy; unpacking is one permute-copy per piece of the gathered sequence when the shards
are even (the received buffer is a strided view of the result), one per peer when they are not.
The output comes back as a [B, H, S_me, D] view of [B, S_me, H, D] memory: the model's own
projection reads it without another copy.

A rank's chunk may hold its shard of the joint text beside its image tokens ([text; image], as
the model joined them). The gathered sequence is then laid out one of two ways:
    rank-major    each rank's chunk as it came, rank after rank: [t0 i0 | t1 i1 | ...]. Attention
                  without a mask does not care where a key sits: one copy each way.
    image first   every rank's image tokens, then every rank's text tokens: [i0 i1 ... | t0 t1 ...],
                  for a text key mask: the image keys are one block (attended unmasked, with the
                  fastest kernel) and the text keys another, in the text's own order.
Text that is whole on every rank (PipeFusion keeps it so: `joint=`) is not exchanged on the way in
(a rank slices its heads); its output rides in the second all-to-all, which gathers it over heads.
"""

from __future__ import annotations

import itertools

import torch

from .. import comm
from ..mesh import ULYSSES


def gathered_pieces(sizes: list[int], text_sizes: list[int] | None = None, *, text_first: bool = True):
    """Where each rank's chunk goes in the gathered sequence, as a list of pieces: (where the piece's
    tokens begin in the gathered sequence, [(offset in rank j's chunk, length) for every rank j]), the
    ranks' tokens of one piece side by side in rank order.

    sizes: every rank's chunk length. text_sizes None: rank-major (one piece, every chunk whole).
    text_sizes (each chunk's text tokens, before its image tokens when text_first): image first."""
    if text_sizes is None:
        return [(0, [(0, n) for n in sizes])]
    image = [n - t for n, t in zip(sizes, text_sizes)]
    image_piece = [(t if text_first else 0, i) for i, t in zip(image, text_sizes)]
    text_piece = [(0 if text_first else i, t) for i, t in zip(image, text_sizes)]
    return [(0, image_piece), (sum(image), text_piece)]


def seq_to_heads(xs, mesh, sizes: list[int], *, pieces=None, tag: str = "") -> list[torch.Tensor]:
    """Each x[B, H, S_me, D] of `xs` (one shape, any strides) -> x[B, H/N, S, D]: scatter heads,
    gather the sequence. All of `xs` (q, k and v) travel in one all-to-all; each is copied once into
    the send buffer, and the received buffer is copied out once per piece (even shards) or once per
    piece and peer (uneven). sizes: every group rank's chunk length; pieces: the gathered layout
    (`gathered_pieces`; rank-major when None)."""
    batch, heads, local, head_dim = xs[0].shape
    n, m = len(sizes), len(xs)
    per_rank = heads // n
    pieces = pieces or gathered_pieces(sizes)
    send = xs[0].new_empty((n, m, batch, local, per_rank, head_dim))  # [to rank j][tensor i], token-major
    for i, x in enumerate(xs):
        send[:, i].copy_(x.unflatten(1, (n, per_rank)).permute(1, 0, 3, 2, 4))
    token = m * batch * per_rank * head_dim  # elements per token of what one peer sends
    received = comm.all_to_all(send.view(-1), [local * token] * n, [s * token for s in sizes], mesh, ULYSSES, tag=tag)
    out = send.new_empty((m, batch, per_rank, sum(sizes), head_dim))
    even = len(set(sizes)) == 1
    chunks = (
        received.view(n, m, batch, sizes[0], per_rank, head_dim)
        if even
        else [
            c.view(m, batch, s, per_rank, head_dim) for c, s in zip(received.split([s * token for s in sizes]), sizes)
        ]
    )
    for base, piece in pieces:
        offset, length = piece[0]
        if even and len(set(piece)) == 1:  # one strided copy for every peer's piece
            if length:
                source = chunks[:, :, :, offset : offset + length].permute(1, 2, 4, 0, 3, 5)
                out[:, :, :, base : base + n * length].unflatten(3, (n, length)).copy_(source)
            continue
        for chunk, (offset, length), start in zip(chunks, piece, _starts([p[1] for p in piece])):
            if length:
                source = chunk[:, :, offset : offset + length].permute(0, 1, 3, 2, 4)
                out[:, :, :, base + start : base + start + length].copy_(source)
    return list(out.unbind(0))


def heads_to_seq(x: torch.Tensor, mesh, sizes: list[int], *, pieces=None, joint=None, tag: str = ""):
    """x[B, H/N, S, D] (the gathered layout `pieces` describes; rank-major when None) -> this rank's
    chunk [B, H, S_me, D] in its own token order: scatter the sequence, gather heads. The result is a
    view of [B, S_me, H, D] memory. `joint`, the text output [B, H/N, T, D] whole on every rank, rides
    in the same all-to-all (in every peer's chunk) and comes back with all heads.
    Returns (out, joint_out or None)."""
    batch, per_rank, _, head_dim = x.shape
    n, me = len(sizes), mesh.group_rank(ULYSSES)
    pieces = pieces or gathered_pieces(sizes)
    text = 0 if joint is None else joint.shape[2]
    token = batch * per_rank * head_dim  # elements per token of one rank's heads
    chunk_sizes = [s + text for s in sizes]  # what each peer receives from this rank, in tokens
    send = x.new_empty(sum(chunk_sizes) * token)
    even = len(set(sizes)) == 1
    chunks = (
        send.view(n, batch, chunk_sizes[0], per_rank, head_dim)
        if even
        else [
            c.view(batch, s, per_rank, head_dim)
            for c, s in zip(send.split([s * token for s in chunk_sizes]), chunk_sizes)
        ]
    )
    for base, piece in pieces:
        offset, length = piece[0]
        if even and len(set(piece)) == 1:
            if length:
                source = x[:, :, base : base + n * length].unflatten(2, (n, length)).permute(2, 0, 3, 1, 4)
                chunks[:, :, offset : offset + length].copy_(source)
            continue
        for chunk, (offset, length), start in zip(chunks, piece, _starts([p[1] for p in piece])):
            if length:
                chunk[:, offset : offset + length].copy_(x[:, :, base + start : base + start + length].transpose(1, 2))
    if text:  # the text output, whole, to every peer
        if even:
            chunks[:, :, sizes[0] :].copy_(joint.transpose(1, 2).unsqueeze(0).expand(n, -1, -1, -1, -1))
        else:
            for chunk, size in zip(chunks, sizes):
                chunk[:, size:].copy_(joint.transpose(1, 2))
    mine = sizes[me]
    received = comm.all_to_all(
        send, [s * token for s in chunk_sizes], [(mine + text) * token] * n, mesh, ULYSSES, tag=tag
    )
    received = received.view(n, batch, mine + text, per_rank, head_dim)
    out = x.new_empty((batch, mine, n, per_rank, head_dim))  # [B, S_me, H, D]: heads in source order
    out.copy_(received[:, :, :mine].permute(1, 2, 0, 3, 4))
    out = out.view(batch, mine, n * per_rank, head_dim).transpose(1, 2)
    if not text:
        return out, None
    joint_out = joint.new_empty((batch, text, n, per_rank, head_dim))
    joint_out.copy_(received[:, :, mine:].permute(1, 2, 0, 3, 4))
    return out, joint_out.view(batch, text, n * per_rank, head_dim).transpose(1, 2)


def _starts(sizes: list[int]) -> list[int]:
    """Where each rank's tokens begin in the gathered sequence."""
    return [0, *itertools.accumulate(sizes)][:-1]


def ulysses_attention(q, k, v, mesh, seq_sizes: list[int], inner, *, joint=None, joint_mask=None, scale=None):
    """Attention over the Ulysses group's whole sequence, computed on H/N heads per rank, with the
    joint text (if any) whole on every rank.

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
