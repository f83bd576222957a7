"""Sequence-parallel attention on real gloo ranks against serial SDPA on the whole tensors.

Every rank builds the same full q, k, v (same seed), takes its shard, runs sp_attention and
compares its output shard with F.scaled_dot_product_attention on the whole tensors."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from xdit_lab import ParallelConfig, RankMesh, comm_log
from xdit_lab.attention import local_attention, merge_attention, merge_stacked, sp_attention
from xdit_lab.sharding import shard_sizes, take_shard
from xdit_lab.testing import run_on_ranks

BATCH, HEADS, HEAD_DIM, TEXT_LEN = 2, 4, 16, 5
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _tensors(seq_len, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=g).to(dtype)  # noqa: E731
    return [make(seq_len) for _ in range(3)], [make(TEXT_LEN) for _ in range(3)]


def _reference(kind, image, text):
    full = [t.float() for t in image]
    if kind == "self":
        return F.scaled_dot_product_attention(*full), None
    if kind == "cross":
        return F.scaled_dot_product_attention(full[0], text[1].float(), text[2].float()), None
    joint = [torch.cat([i, t.float()], dim=2) for i, t in zip(full, text)]
    out = F.scaled_dot_product_attention(*joint)
    seq_len = image[0].shape[2]
    return out[:, :, :seq_len], out[:, :, seq_len:]


def _run_cases(config, cases):
    mesh = RankMesh(config)
    sp, sp_rank = mesh.group_size("sp"), mesh.group_rank("sp")
    results = []
    for kind, seq_len, dtype in cases:
        image, text = _tensors(seq_len, dtype, seed=seq_len)
        ref_out, ref_joint = _reference(kind, image, text)
        q, k, v = (take_shard(t, 2, sp, sp_rank) for t in image)
        with comm_log() as log:
            if kind == "self":
                out, joint_out = sp_attention(q, k, v, mesh, seq_len=seq_len), None
            elif kind == "cross":
                out, joint_out = sp_attention(q, text[1], text[2], mesh, kv_sharded=False), None
            else:
                out, joint_out = sp_attention(
                    q, k, v, mesh, joint_q=text[0], joint_k=text[1], joint_v=text[2], seq_len=seq_len
                )
        errors = [(out.float() - take_shard(ref_out, 2, sp, sp_rank)).abs().max().item()]
        if joint_out is not None:
            errors.append((joint_out.float() - ref_joint).abs().max().item())
        results.append(
            dict(
                case=(kind, seq_len, str(dtype)),
                error=max(errors),
                out_dtype=str(out.dtype),
                local_len=q.shape[2],
                records=log.summary(),
                joint_bits=None if joint_out is None else joint_out.float().sum().item(),
            )
        )
    return results


CONFIGS = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=2),
    ParallelConfig(ulysses=2, ring=2),
    ParallelConfig(ulysses=4),
    ParallelConfig(ring=4),
]
CASES = list(itertools.product(("self", "joint", "cross"), (32, 37), (torch.float32, torch.bfloat16)))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short())
def test_sp_attention_matches_serial_sdpa(config):
    results = run_on_ranks(_run_cases, config.world_size, config, CASES)
    for rank_results in results:
        for r in rank_results:
            kind, seq_len, dtype = r["case"]
            assert r["error"] <= TOLERANCE[getattr(torch, dtype.split(".")[1])], r["case"]
            assert r["out_dtype"] == dtype
    # uneven case really is uneven, and text outputs agree bit for bit on every rank
    uneven = CASES.index(("self", 37, torch.float32))
    assert len({rank_results[uneven]["local_len"] for rank_results in results}) == 2
    for i, (kind, _, _) in enumerate(CASES):
        if kind == "joint":
            assert len({rank_results[i]["joint_bits"] for rank_results in results}) == 1


def _bytes_of(shape, dtype_bytes=4):
    n = 1
    for s in shape:
        n *= s
    return n * dtype_bytes


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short())
def test_counted_bytes_match_closed_form(config):
    results = run_on_ranks(
        _run_cases, config.world_size, config, [("self", 32, torch.float32), ("cross", 32, torch.float32)]
    )
    u, r = config.ulysses, config.ring
    local = _bytes_of((BATCH, HEADS, 32 // (u * r), HEAD_DIM))
    for self_case, cross_case in results:
        records = self_case["records"]
        a2a = [x for x in records if x["op"] == "all_to_all"]
        sends = [x for x in records if x["op"] == "send"]
        # Ulysses: q, k, v in one all-to-all, o in a second; (N-1)/N of each leaves the rank
        assert [(x["group"], x["tag"]) for x in a2a] == ([("ulysses", "qkv"), ("ulysses", "out")] if u > 1 else [])
        for x, tensors in zip(a2a, (3, 1)):
            assert x["bytes"] == tensors * local and x["bytes_out"] == tensors * local * (u - 1) // u
        # Ring: N-1 transfers of a K/V block (2 × the block each rank holds after Ulysses)
        assert len(sends) == r - 1
        assert all(x["group"] == "ring" and x["bytes_out"] == 2 * local for x in sends)
        assert {x["op"] for x in records} <= {"all_to_all", "send"}
        assert cross_case["records"] == []  # cross-attention is local: nothing moves


def _heads_error(config):
    mesh = RankMesh(config)
    q = torch.randn(1, 1, 4, 8)
    try:
        sp_attention(q, q, q, mesh, seq_len=8)
    except ValueError as error:
        return str(error)
    return None


def test_fewer_heads_than_ulysses_ranks_is_refused_by_name():
    """Any head count splits over Ulysses (tests/test_uneven_heads.py), one head per rank at least."""
    messages = run_on_ranks(_heads_error, 2, ParallelConfig(ulysses=2))
    assert all(
        m and "1 attention heads cannot give each of ulysses 2 ranks a head; use ulysses <= 1" in m for m in messages
    )


def test_local_attention_lse_merge_is_exact():
    """Splitting the keys in blocks and merging with the LSE reproduces full attention."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 11, 8, generator=g) for _ in range(3))
    full_out, full_lse = local_attention(q, k, v)
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    assert torch.allclose(full_lse, scores.logsumexp(-1), atol=1e-5)  # a true LSE, not a zero
    out = lse = None
    for k_block, v_block in zip(k.split([4, 4, 3], dim=2), v.split([4, 4, 3], dim=2)):
        out, lse = merge_attention(out, lse, *local_attention(q, k_block, v_block))
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() < 1e-6
    assert (lse - full_lse).abs().max() < 1e-5


def test_shard_sizes_follow_tensor_split():
    for total, parts in [(32, 4), (37, 4), (5, 2), (7, 3)]:
        assert shard_sizes(total, parts) == [len(c) for c in torch.arange(total).tensor_split(parts)]


def test_backend_is_reported_and_can_be_overridden():
    from xdit_lab.attention import attention_backend, set_attention_backend

    assert attention_backend("cpu") == "cpu_flash"
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    try:
        set_attention_backend("math")
        assert attention_backend("cpu") == "math"
        out, lse = local_attention(q, k, v)
    finally:
        set_attention_backend(None)
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() < 1e-6
    assert torch.allclose(lse, local_attention(q, k, v)[1], atol=1e-5)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'; choose one of flash_attn"):
        set_attention_backend("fast")


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
def test_padded_text_key_mask_equals_sdpa_with_the_whole_mask(backend):
    """Image and text attended with a [B, T] key mask over the text (Qwen-Image's padding) equal SDPA
    given the whole [B, 1, 1, S + T] mask, for every pattern: a full text, a padded one, a hole, and a
    text that is all padding (that sample's text block must weigh nothing: its lse is -inf). The
    control: the kernel's own lse for that all-padding block (0 on CPU) would change the result."""
    from xdit_lab.attention import joint_local_attention, set_attention_backend

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 2, 9, 8, generator=g) for _ in range(3))
    text = tuple(torch.randn(4, 2, 5, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    whole = torch.cat([torch.ones(4, 9, dtype=torch.bool), mask], dim=1)[:, None, None]
    reference = F.scaled_dot_product_attention(*(torch.cat(pair, dim=2) for pair in zip((q, k, v), text)), whole)
    try:
        set_attention_backend(backend)
        out, text_out = joint_local_attention(q, k, v, joint=text, joint_mask=mask)
        _, dead_lse = local_attention(q, text[1], text[2], key_mask=mask)
    finally:
        set_attention_backend(None)
    assert (torch.cat([out, text_out], dim=2) - reference).abs().max() < 1e-5
    assert torch.isinf(dead_lse[3]).all() and torch.isfinite(dead_lse[:3]).all()
    image_out, image_lse = local_attention(q, k, v)
    zero_lse = torch.where(torch.isinf(dead_lse), 0.0, dead_lse)  # what the kernel reports for no keys
    wrong, _ = merge_attention(image_out, image_lse, torch.zeros_like(q), zero_lse)
    assert (wrong[3] - reference[3, :, :9]).abs().max() > 1e-2


# ---- the joint text sharded like the image (sp_attention_sharded) ---------------------------------------


def _text_mask(text_len):
    """[BATCH, text_len]: sample 0 attends every text key, sample 1 has its last two padded."""
    return torch.arange(text_len)[None, :] < torch.tensor([[text_len], [text_len - 2]])


def _run_sharded_cases(config, cases):
    """Each rank holds its shard of the image and of the text, joined in the module's order ([text;
    image] when the text comes first); sp_attention_sharded's output against serial SDPA over the whole
    [image; text] (with the text's key mask where the case masks it)."""
    from xdit_lab.attention import sp_attention_sharded

    mesh = RankMesh(config)
    sp, sp_rank = mesh.group_size("sp"), mesh.group_rank("sp")
    results = []
    for kind, seq_len, text_len, dtype in cases:
        image, _ = _tensors(seq_len, dtype, seed=seq_len)
        g = torch.Generator().manual_seed(text_len)
        text = (
            [torch.randn(BATCH, HEADS, text_len, HEAD_DIM, generator=g).to(dtype) for _ in range(3)]
            if text_len
            else None
        )
        masked, text_first = kind.startswith("masked"), kind.endswith("first")
        mask = _text_mask(text_len) if masked else None
        whole = [torch.cat([i, t], dim=2).float() for i, t in zip(image, text)] if text else [i.float() for i in image]
        key_mask = None if mask is None else torch.cat([torch.ones(BATCH, seq_len, dtype=torch.bool), mask], 1)
        reference = F.scaled_dot_product_attention(
            *whole, attn_mask=None if key_mask is None else key_mask[:, None, None]
        )
        image_sizes = shard_sizes(seq_len, sp)
        text_sizes = shard_sizes(text_len, sp) if text else None
        mine = [take_shard(t, 2, sp, sp_rank) for t in image]
        expected = take_shard(reference[:, :, :seq_len], 2, sp, sp_rank)
        if text:
            words = [take_shard(t, 2, sp, sp_rank) for t in text]
            mine = [torch.cat([w, i] if text_first else [i, w], dim=2) for i, w in zip(mine, words)]
            expected_text = take_shard(reference[:, :, seq_len:], 2, sp, sp_rank)
            expected = torch.cat([expected_text, expected] if text_first else [expected, expected_text], dim=2)
        with comm_log() as log:
            out = sp_attention_sharded(*mine, mesh, image_sizes, text_sizes, text_first=text_first, text_mask=mask)
        results.append(
            dict(
                case=(kind, seq_len, text_len, str(dtype)),
                error=(out.float() - expected).abs().max().item(),
                out_dtype=str(out.dtype),
                shape_ok=out.shape == mine[0].shape,
                token_major=out.transpose(1, 2).is_contiguous(),
                bytes_out=sum(r.bytes_out for r in log),
            )
        )
    return results


SHARDED_CASES = [
    *itertools.product(("self",), (32, 37), (0,), (torch.float32,)),
    *itertools.product(("text_first", "text_last", "masked_first", "masked_last"), (32, 37), (8, 5), (torch.float32,)),
    ("text_first", 37, 5, torch.bfloat16),
    ("masked_last", 37, 5, torch.bfloat16),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.short())
def test_sharded_text_attention_matches_serial_sdpa(config):
    """Image and text both sharded over the sp ranks (even and uneven shards of each), the text before
    or after the image in a rank's tokens, with and without padded text keys: every rank's output equals
    serial SDPA over the whole sequence, in its own token order, laid out as [B, S, H, D] in memory
    (the model's projection reads it without a copy)."""
    for rank_results in run_on_ranks(_run_sharded_cases, config.world_size, config, SHARDED_CASES, timeout_s=240):
        for r in rank_results:
            kind, seq_len, text_len, dtype = r["case"]
            assert r["error"] <= TOLERANCE[getattr(torch, dtype.split(".")[1])], r
            assert r["out_dtype"] == dtype and r["shape_ok"] and r["token_major"], r
            assert r["bytes_out"] > 0, r


def _text_shorter_than_sp(config):
    """A text of 1 token over 2 sp ranks: one rank's text shard is empty, and attention is still exact."""
    from xdit_lab.attention import sp_attention_sharded

    mesh = RankMesh(config)
    sp, sp_rank = mesh.group_size("sp"), mesh.group_rank("sp")
    image, text = _tensors(16, torch.float32, seed=4)
    text = [t[:, :, :1] for t in text]
    reference = F.scaled_dot_product_attention(*(torch.cat(pair, dim=2) for pair in zip(image, text)))
    mine = [take_shard(t, 2, sp, sp_rank) for t in image]
    words = [take_shard(t, 2, sp, sp_rank) for t in text]
    out = sp_attention_sharded(
        *(torch.cat(pair, dim=2) for pair in zip(words, mine)), mesh, shard_sizes(16, sp), shard_sizes(1, sp)
    )
    expected = torch.cat(
        [take_shard(reference[:, :, 16:], 2, sp, sp_rank), take_shard(reference[:, :, :16], 2, sp, sp_rank)], 2
    )
    return (out - expected).abs().max().item()


@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: c.short())
def test_an_empty_text_shard_is_exact(config):
    assert max(run_on_ranks(_text_shorter_than_sp, config.world_size, config)) < 1e-5


# ---- what one attention costs in operators: copies and merges that do not grow with the degree ---------


class _AtenOps(TorchDispatchMode):
    """Every aten operator called that is not a view, in order: what a GPU would launch as kernels
    (views, transposes and slices move no data)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _count_ops(config, seq_len, text_len):
    """Aten operators of one sp_attention_sharded call on this rank (image and text sharded)."""
    from xdit_lab.attention import sp_attention_sharded

    mesh = RankMesh(config)
    sp, sp_rank = mesh.group_size("sp"), mesh.group_rank("sp")
    image_sizes, text_sizes = shard_sizes(seq_len, sp), shard_sizes(text_len, sp)
    g = torch.Generator().manual_seed(0)
    local = image_sizes[sp_rank] + text_sizes[sp_rank]
    q, k, v = (torch.randn(BATCH, local, HEADS, HEAD_DIM, generator=g).transpose(1, 2) for _ in range(3))
    with _AtenOps() as seen:
        sp_attention_sharded(q, k, v, mesh, image_sizes, text_sizes)
    return seen.ops


LSE_KERNEL = "_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize("degree", [2, 4])
def test_ulysses_packs_and_unpacks_with_one_copy_per_side_on_even_shards(degree):
    """Even shards (32 image + 8 text tokens): q, k, v one copy each into the send buffer, one copy out
    of the received one, then one copy each way for the output: 6 copies whatever the degree. Uneven
    shards (37 + 5) take a copy per peer, so their count grows with the degree: the count is the
    kernels' own, not a constant of the test."""
    config = ParallelConfig(ulysses=degree)
    even = run_on_ranks(_count_ops, degree, config, 32, 8)[0]
    uneven = run_on_ranks(_count_ops, degree, config, 37, 5)[0]
    assert even.count("copy_") == 6, even
    assert even.count("alltoall_base_") == 2 and even.count(LSE_KERNEL) == 1
    assert uneven.count("copy_") >= 6 + degree, uneven


def test_ring_merges_all_blocks_in_one_go():
    """Ring 2 and Ring 4: one LSE kernel per block (the degree's count), and after the last kernel a
    handful of operators merge them all (two parts: sigmoid and lerp, fewer still). merge_stacked of 3,
    4 and 8 parts runs the same operators, however many there were: the merge is O(1) operators. The
    control folds the same partial results with merge_attention, block by block: its count grows with
    the number of parts. Both merges agree to 1e-6, the two-part one included."""
    after_last = {}
    for degree in (2, 4):
        ops = run_on_ranks(_count_ops, degree, ParallelConfig(ring=degree), 32, 8)[0]
        assert ops.count(LSE_KERNEL) == degree, ops
        last = len(ops) - 1 - ops[::-1].index(LSE_KERNEL)
        after_last[degree] = ops[last + 1 :]
    assert len(after_last[2]) <= len(after_last[4]) <= 10, after_last

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 8, generator=g)
    chained = {}
    for count in (2, 3, 4, 8):
        parts = [local_attention(q, *(torch.randn(1, 2, 5, 8, generator=g) for _ in range(2))) for _ in range(count)]
        with _AtenOps() as stacked:
            merged = merge_stacked(parts)
        with _AtenOps() as folded:
            out = lse = None
            for part in parts:
                out, lse = merge_attention(out, lse, *part)
        assert (merged - out).abs().max() < 1e-6, count
        chained[count] = (len(stacked.ops), len(folded.ops))
    assert chained[3][0] == chained[4][0] == chained[8][0] and chained[8][1] > chained[3][1] + 8, chained
    assert chained[2][0] <= 6, chained


@pytest.mark.parametrize("token_major", [False, True])
def test_merging_two_parts_weighs_a_part_without_keys_zero(token_major):
    """merge_stacked of two parts (its sigmoid-and-lerp path) against the stacked softmax of the same
    parts with a third that weighs nothing: equal where both parts have keys, the live part's output
    where one has none (lse -inf, out 0), and 0 where neither has any (not nan). token_major: the
    result lies as [B, S, H, D] in memory. bf16 outputs are merged in float32 and returned in bf16."""
    g = torch.Generator().manual_seed(3)
    outs = [torch.randn(2, 3, 5, 4, generator=g) for _ in range(2)]
    lses = [torch.randn(2, 3, 5, generator=g) for _ in range(2)]
    lses[0][0, 1], outs[0][0, 1] = float("-inf"), 0.0  # sample 0, head 1: part 0 has no key
    lses[1][1, 2, :2], outs[1][1, 2, :2] = float("-inf"), 0.0  # part 1 has none for two queries
    lses[0][1, 0, 4] = lses[1][1, 0, 4] = float("-inf")  # neither has any for one query
    outs[0][1, 0, 4] = outs[1][1, 0, 4] = 0.0
    dead = (torch.zeros(2, 3, 5, 4), torch.full((2, 3, 5), float("-inf")))  # a third part that weighs 0
    for dtype in (torch.float32, torch.bfloat16):
        parts = [(o.to(dtype), lse) for o, lse in zip(outs, lses)]
        two = merge_stacked(parts, token_major=token_major)
        three = merge_stacked([*parts, (dead[0].to(dtype), dead[1])], token_major=token_major)
        assert two.dtype == dtype and torch.isfinite(two.float()).all()
        assert (two.float() - three.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(two[0, 1].float(), outs[1][0, 1].to(dtype).float())
        assert torch.equal(two[1, 0, 4], torch.zeros(4, dtype=dtype))
        assert two.transpose(1, 2).is_contiguous() == token_major
