"""Loading FSDP2 shards from safetensors: what each reader costs a rank in host memory and reads.

    python benchmarks/shard_loading.py [--mib 336] [--ranks 2] [--address-limit]

A plain torch model of a few large blocks (float32, --mib of weights, saved by safetensors in two
files with an index.json) is built on meta on every rank, fully_shard-ed per block and root, and
loaded three ways, each in fresh rank processes:

- ours: xdit_lab.shard_loading.materialize + load_weights (preadv of this rank's rows)
- dcp: torch's own `torch.distributed.checkpoint.load(model.state_dict(),
  storage_reader=HuggingFaceStorageReader(folder))` after `model.to_empty(device="cpu")`
- load_file: safetensors.torch.load_file of every file on the rank, every tensor then read once
  (the control: what a rank that builds the whole state dict holds; safetensors 0.8's tensors map
  the file and page in when read, so unread they cost almost nothing resident)

Per rank: the rise of the peak resident set during the load (VmHWM after the load minus VmRSS
when the peak was reset by writing 5 to /proc/self/clear_refs), the resident file-backed and
anonymous memory just after it, rchar (bytes read() and pread() returned: mmap reads are not in
it) and read_bytes (bytes fetched from the disk, with the files' pages first evicted from the page
cache by posix_fadvise DONTNEED: readahead makes it a little more than asked), beside the rank's
shard and the largest tensor. Each loaded shard is checked against safetensors' own reader.

With --address-limit each rank loads under an address-space limit (RLIMIT_AS) of its current
virtual size + its shard + 256 MiB, which fits the shard but not a mapping of a whole file: the
condition of "Unable to mmap 9989150328 bytes".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import tempfile
import time
from pathlib import Path

import torch

from xdit_lab.testing import run_on_ranks

MiB = 2**20


class Blocks(torch.nn.Module):
    """`blocks` pairs of Linear(width, 2·width) and Linear(2·width, width)."""

    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width))
            for _ in range(blocks)
        )


def save(folder: Path, blocks: int, width: int) -> None:
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Blocks(blocks, width).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    keys = list(shapes)
    halves = {"w-1.safetensors": keys[: len(keys) // 2], "w-2.safetensors": keys[len(keys) // 2 :]}
    for name, part in halves.items():
        save_file({k: torch.randn(shapes[k], generator=g) for k in part}, folder / name)
        with open(folder / name, "rb") as f:
            os.fsync(f.fileno())  # written back, so fadvise can evict its pages
    weight_map = {k: name for name, part in halves.items() for k in part}
    (folder / "w.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def load(folder: Path, blocks: int, width: int, method: str, address_limit: bool):
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from xdit_lab.shard_loading import load_weights, materialize, rows_of_this_rank

    files = sorted(folder.glob("*.safetensors"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Blocks(blocks, width)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    dist.barrier()
    if address_limit:
        limit = status_kib("VmSize") * 1024 + shard + 256 * MiB
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0, io0, start = status_kib("VmRSS"), io(), time.perf_counter()
    error = None
    try:
        if method == "ours":
            materialize(model, "cpu")
            load_weights(model, folder, dtype=torch.float32)
        elif method == "dcp":
            import torch.distributed.checkpoint as dcp

            model.to_empty(device="cpu")
            dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
        else:
            from safetensors.torch import load_file

            held = [load_file(f) for f in files]  # tensors that map the files, paged in when read:
            sum(float(t.sum()) for tensors in held for t in tensors.values())  # read, as a copy into a model would
    except BaseException as e:  # under --address-limit: what the reader says (DCP's CheckpointException
        if isinstance(e, KeyboardInterrupt):  # is a BaseException)
            raise
        message = " ".join(str(e).split())
        mmap = re.search(r"unable to mmap \d+ bytes from file \S+", message, re.IGNORECASE)
        error = f"{type(e).__name__}: {mmap.group(0) if mmap else message[-160:]}"
    seconds = time.perf_counter() - start
    rise = status_kib("VmHWM") - rss0
    io1, file_kib, anon_kib = io(), status_kib("RssFile"), status_kib("RssAnon")
    if address_limit:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    same = None
    if method != "load_file" and error is None:  # this rank's rows against safetensors' own reader
        same = True
        for f in files:
            with safe_open(f, framework="pt") as reader:
                for key in reader.keys():
                    p = model.get_parameter(key)
                    first, rows = rows_of_this_rank(p, key)
                    same &= torch.equal(p.to_local(), reader.get_slice(key)[first : first + rows])
    return dict(
        rise=rise * 1024,
        rss_file=file_kib * 1024,
        rss_anon=anon_kib * 1024,
        rchar=io1["rchar"] - io0["rchar"],
        read_bytes=io1["read_bytes"] - io0["read_bytes"],
        seconds=seconds,
        shard=shard,
        largest=largest,
        same=same,
        error=error,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=336, help="about this many MiB of float32 weights")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--address-limit", action="store_true")
    parser.add_argument("--methods", nargs="+", default=["ours", "dcp", "load_file"])
    args = parser.parse_args()
    per_block = 4 * 4 * args.width * args.width
    blocks = max(1, round(args.mib * MiB / per_block))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save(folder, blocks, args.width)
        total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(
            f"{blocks} blocks of width {args.width}: {total / MiB:.0f} MiB in 2 files, {args.ranks} ranks"
            + (", under an address-space limit of VmSize + shard + 256 MiB" if args.address_limit else "")
        )
        print(
            "| reader | rank | shard MiB | peak rise MiB | rise / shard | RssFile MiB | rchar MiB | read_bytes MiB "
            "| s | rows equal | error |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for method in args.methods:
            out = run_on_ranks(load, args.ranks, folder, blocks, args.width, method, args.address_limit, timeout_s=600)
            for rank, r in enumerate(out):
                print(
                    f"| {method} | {rank} | {r['shard'] / MiB:.0f} | {r['rise'] / MiB:.0f} | {r['rise'] / r['shard']:.2f} "
                    f"| {r['rss_file'] / MiB:.0f} | {r['rchar'] / MiB:.1f} | {r['read_bytes'] / MiB:.0f} "
                    f"| {r['seconds']:.2f} | {r['same']} | {r['error'] or ''} |"
                )
        print(f"largest tensor: {out[0]['largest'] / MiB:.0f} MiB")


if __name__ == "__main__":
    main()
