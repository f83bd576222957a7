"""Time Ulysses, Ring and USP attention on 1, 2 and 4 CPU ranks beside serial SDPA, and the bytes
each call moves beside the closed form.

    python benchmarks/attention.py [--lengths 1024 2048 4096 8192 16384] [--heads 8] [--head-dim 32]

Serial SDPA is timed in the same run, on rank 0 with that rank's threads, while the other ranks wait. On a machine with
fewer cores than ranks the parallel figures include the ranks competing for cores: compare
methods with each other, and read speed-ups only where ranks have cores (or GPUs) of their own.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from xdit_lab import ParallelConfig, RankMesh, comm_log, sp_attention
from xdit_lab.sharding import take_shard
from xdit_lab.testing import run_on_ranks

METHODS = {
    1: [ParallelConfig()],
    2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2)],
    4: [ParallelConfig(ulysses=4), ParallelConfig(ring=4), ParallelConfig(ulysses=2, ring=2)],
}


def formula_bytes(config, seq_len, heads, head_dim, element_bytes=4):
    """Bytes leaving one rank per call: Ulysses q, k, v and o each (N-1)/N of a local shard,
    Ring N-1 K/V blocks (after Ulysses, a ring block holds seq/ring tokens for heads/ulysses)."""
    u, r = config.ulysses, config.ring
    shard = seq_len // (u * r) * heads * head_dim * element_bytes
    return 4 * shard * (u - 1) // u + (r - 1) * 2 * shard


def _median_ms(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _bench(configs, lengths, heads, head_dim, repeats):
    rows = []
    for seq_len in lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, heads, seq_len, head_dim, generator=g) for _ in range(3))
        serial_ms = None
        if dist.get_rank() == 0:
            serial_ms = _median_ms_local(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v), repeats)
        dist.barrier()
        for config in configs:
            mesh = RankMesh(config)
            shards = [take_shard(t, 2, config.sp_degree, mesh.group_rank("sp")) for t in (q, k, v)]
            ms = _median_ms(lambda shards=shards, mesh=mesh, n=seq_len: sp_attention(*shards, mesh, seq_len=n), repeats)
            with comm_log() as log:
                sp_attention(*shards, mesh, seq_len=seq_len)
            rows.append(
                dict(
                    seq_len=seq_len,
                    method=config.short(),
                    ranks=config.world_size,
                    ms=ms,
                    serial_ms=serial_ms,
                    bytes=sum(r.bytes_out for r in log),
                    formula=formula_bytes(config, seq_len, heads, head_dim),
                )
            )
    return rows


def _median_ms_local(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], choices=[1, 2, 4])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    print(
        f"{'tokens':>7} {'method':>18} {'ranks':>5} {'ms/call':>10} {'serial ms':>10} {'speed-up':>8} "
        f"{'bytes out/rank':>15} {'formula':>12}"
    )
    for ranks in args.ranks:
        per_rank = run_on_ranks(
            _bench, ranks, METHODS[ranks], args.lengths, args.heads, args.head_dim, args.repeats, timeout_s=3600
        )
        serial = {row["seq_len"]: row["serial_ms"] for row in per_rank[0]}
        for row in per_rank[0]:
            slowest = max(rank_rows[per_rank[0].index(row)]["ms"] for rank_rows in per_rank)
            ref = serial[row["seq_len"]]
            print(
                f"{row['seq_len']:>7} {row['method']:>18} {ranks:>5} {slowest:>10.1f} {ref:>10.1f} "
                f"{ref / slowest:>8.2f} {row['bytes']:>15,} {row['formula']:>12,}"
            )


if __name__ == "__main__":
    main()
