"""Ulysses attention: trade sequence shards for head shards with two all-to-alls.

Each of the N ranks of a Ulysses group holds a chunk of the sequence with all H heads. An
all-to-all gives every rank the whole (group's) sequence for its share of the heads, attention
runs there unsplit, and a second all-to-all gives each rank its sequence chunk back with all heads:

    q[B, H, S/N, D] --all-to-all--> q[B, H_r, S, D] --attention--> o[B, H_r, S, D]
                    --all-to-all--> o[B, H, S/N, D]

q, k, v and o each cross the network once; (N-1)/N of each leaves the rank. q, k and v share
the first all-to-all, o the second: two collectives per attention. Shards may have unequal
lengths (S not divisible by N): the all-to-all moves them as they are, nothing padded.

Any head count: rank r attends H_r heads, the r-th piece of torch.tensor_split's split of the H
heads (`head_counts`), so the first H mod N ranks take one head more. 30 heads over 4 ranks:

    heads     0 ........ 7 | 8 ....... 15 | 16 ..... 22 | 23 ..... 29
    rank           0       |       1      |      2      |      3          H_r = 8, 8, 7, 7

The all-to-all takes a size per peer (all_to_all_single's split sizes), so each peer gets exactly
its heads. The other way to fit N is to pad the heads to a multiple of N with zeros and drop them
after (diffusers' `ulysses_anything` does that); judged by the bytes moved, the uneven split wins.
A rank sends 3·B·S_me·D elements for every head it does not keep (q, k, v) and B·(S - S_me)·D for
every head it does (o); in units of B·(S/N)·D for even shards, per rank:

                              q, k, v         o            30 heads, N = 4    3 heads, N = 2
    uneven (H_r heads)        3·(H - H_r)     (N-1)·H_r    90, 90, 90, 90     5, 7
    padded (H' = N·ceil(H/N)) 3·(H' - H'/N)   (N-1)·H'/N   96 each            8 each

zeros included. The busiest rank attends ceil(H/N) heads either way (padded, the last rank's
heads hold the zeros). Under USP a ring group's ranks share a Ulysses coordinate, so they hold
the same H_r heads and Ring runs unchanged.

What travels is token-major, [B, tokens, H_r, D] per peer (q, k, v side by side on the way in),
the layout the model's projections write and read. Packing a tensor for every peer is one
permute-copy per run of peers with one head count (one run when N divides H, two when it does
not: the ceil ranks, then the floor ranks), whatever N; unpacking is one permute-copy per piece
of the gathered sequence when the shards are even (the received buffer is a strided view of the
result), one per peer when they are not. The output comes back as a [B, H, S_me, D] view of
[B, S_me, H, D] memory: the model's own projection reads it without another copy.

A rank's chunk may hold its shard of the joint text beside its image tokens ([text; image], as
the model joined them). The gathered sequence is then laid out one of two ways:
    rank-major    each rank's chunk as it came, rank after rank: [t0 i0 | t1 i1 | ...]. Attention
                  without a mask does not care where a key sits: one copy each way.
    image first   every rank's image tokens, then every rank's text tokens: [i0 i1 ... | t0 t1 ...],
                  for a text key mask: the image keys are one block (attended unmasked, with the
                  fastest kernel) and the text keys another, in the text's own order.
Text that is whole on every rank (PipeFusion keeps it so: `joint=`) is not exchanged on the way in
(a rank slices its heads); its output rides in the second all-to-all, which gathers it over heads.

With `wire` (ParallelConfig.comm_dtype) both all-to-alls carry float8 with a scale per token and head
(wire.py): the same layout, each row of head_dim elements packed to head_dim + 4 bytes.
"""

from __future__ import annotations

import itertools

import torch

from ..mesh import ULYSSES
from ..sharding import shard_sizes
from . import wire as wire_


def head_counts(heads: int, n: int) -> list[int]:
    """The heads each of the n ranks of a Ulysses group attends, in group order: torch.tensor_split's
    split of `heads` (the first heads mod n ranks take one more)."""
    return shard_sizes(heads, n)


def head_slice(heads: int, n: int, rank: int) -> slice:
    """The heads group rank `rank` attends, as a slice of all `heads`."""
    counts = head_counts(heads, n)
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def _runs(counts: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive peers with one head count, as (first head, peers, heads each): one run when the
    counts are even, two (ceil, then floor) when not. One copy moves a tensor's heads for a whole run."""
    runs, head = [], 0
    for each, group in itertools.groupby(counts):
        peers = len(list(group))
        runs.append((head, peers, each))
        head += peers * each
    return runs


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


def seq_to_heads(xs, mesh, sizes: list[int], *, pieces=None, tag: str = "", wire=None) -> list[torch.Tensor]:
    """Each x[B, H, S_me, D] of `xs` (one shape, any strides) -> x[B, H_me, S, D]: scatter heads (H_me:
    this rank's `head_counts`), gather the sequence. All of `xs` (q, k and v) travel in one all-to-all;
    each is copied into the send buffer once per run of peers with one head count (`_runs`), and the
    received buffer is copied out once per piece (even shards) or once per piece and peer (uneven).
    sizes: every group rank's chunk length; pieces: the gathered layout (`gathered_pieces`; rank-major
    when None); wire: float8 on the wire (wire.py), None: the tensors' own dtype."""
    batch, heads, local, head_dim = xs[0].shape
    n, m = len(sizes), len(xs)
    counts = head_counts(heads, n)
    per_rank = counts[mesh.group_rank(ULYSSES)]
    pieces = pieces or gathered_pieces(sizes)
    row = m * batch * local * head_dim  # elements of one head of what this rank sends, token-major per peer
    send = xs[0].new_empty(heads * row)
    offset = 0
    for head, peers, each in _runs(counts):  # [to peer j][tensor i][B, S_me, heads of j, D]
        block = send[offset : offset + peers * each * row].view(peers, m, batch, local, each, head_dim)
        for i, x in enumerate(xs):
            block[:, i].copy_(x[:, head : head + peers * each].unflatten(1, (peers, each)).permute(1, 0, 3, 2, 4))
        offset += peers * each * row
    token = m * batch * per_rank * head_dim  # elements per token of what one peer sends here
    received = wire_.all_to_all(
        send, [c * row for c in counts], [s * token for s in sizes], mesh, ULYSSES, row=head_dim, wire=wire, tag=tag
    )
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


def heads_to_seq(
    x: torch.Tensor, mesh, sizes: list[int], *, heads: int, pieces=None, joint=None, tag: str = "", wire=None
):
    """x[B, H_me, S, D] (this rank's heads of all `heads`; the gathered layout `pieces` describes,
    rank-major when None) -> this rank's chunk [B, H, S_me, D] in its own token order: scatter the
    sequence, gather heads. The result is a view of [B, S_me, H, D] memory. `joint`, the text output
    [B, H_me, T, D] whole on every rank, rides in the same all-to-all (in every peer's chunk) and comes
    back with all heads. wire: float8 on the wire (wire.py), None: x's dtype. Returns (out, joint_out or None)."""
    batch, per_rank, _, head_dim = x.shape
    n, me = len(sizes), mesh.group_rank(ULYSSES)
    counts = head_counts(heads, n)
    if counts[me] != per_rank:
        raise ValueError(f"ulysses rank {me} attends {counts[me]} of {heads} heads, but x holds {per_rank}")
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
    row = batch * (mine + text) * head_dim  # elements of one head of what each peer sends here
    received = wire_.all_to_all(
        send,
        [s * token for s in chunk_sizes],
        [c * row for c in counts],
        mesh,
        ULYSSES,
        row=head_dim,
        wire=wire,
        tag=tag,
    )
    out = x.new_empty((batch, mine, heads, head_dim))  # [B, S_me, H, D]: heads in source order
    joint_out = None if not text else joint.new_empty((batch, text, heads, head_dim))
    offset = 0
    for head, peers, each in _runs(counts):  # one copy per run of peers with one head count
        block = received[offset : offset + peers * each * row].view(peers, batch, mine + text, each, head_dim)
        out[:, :, head : head + peers * each].unflatten(2, (peers, each)).copy_(
            block[:, :, :mine].permute(1, 2, 0, 3, 4)
        )
        if text:
            joint_out[:, :, head : head + peers * each].unflatten(2, (peers, each)).copy_(
                block[:, :, mine:].permute(1, 2, 0, 3, 4)
            )
        offset += peers * each * row
    return out.transpose(1, 2), None if not text else joint_out.transpose(1, 2)


def _starts(sizes: list[int]) -> list[int]:
    """Where each rank's tokens begin in the gathered sequence."""
    return [0, *itertools.accumulate(sizes)][:-1]


def ulysses_attention(
    q, k, v, mesh, seq_sizes: list[int], inner, *, joint=None, joint_mask=None, scale=None, wire=None
):
    """Attention over the Ulysses group's whole sequence, computed on this rank's share of the heads
    (`head_counts`), with the joint text (if any) whole on every rank.

    seq_sizes: every group rank's local sequence length, in group order. `inner(q, k, v,
    joint=..., joint_mask=..., scale=...)` computes attention on the gathered tensors and returns
    (out, joint_out); it is local attention, or Ring attention when Ulysses runs inside Ring. A
    text key mask is per sample, the same for every head: it goes to `inner` as it is. wire: float8 on
    the wire for both all-to-alls (wire.py)."""
    heads = q.shape[1]
    mine = head_slice(heads, len(seq_sizes), mesh.group_rank(ULYSSES))
    q, k, v = seq_to_heads((q, k, v), mesh, seq_sizes, tag="qkv", wire=wire)
    if joint is not None:  # replicated text: every rank already has every head
        joint = tuple(t[:, mine] for t in joint)
    out, joint_out = inner(q, k, v, joint=joint, joint_mask=joint_mask, scale=scale)
    return heads_to_seq(out, mesh, seq_sizes, heads=heads, joint=joint_out, tag="out", wire=wire)
