"""One of two ranks (RANK from the environment): rank 1 leaves after the mesh is built; rank 0 then
waits in an all-reduce on their ulysses group and must fail within the world's timeout (argv[1]
seconds), not NCCL's default of 10 minutes. Started by gpu_tier.kill_a_rank."""

import os
import sys
import time

import torch

from xdit_lab import ParallelConfig, RankMesh, comm
from xdit_lab.distributed import init_distributed

timeout_s = float(sys.argv[1])
info = init_distributed(timeout_s=timeout_s)
mesh = RankMesh(ParallelConfig(ulysses=2))
comm.all_reduce(torch.ones(1024, device=info.device), mesh, "ulysses")  # both ranks are here
torch.cuda.synchronize(info.device)
if info.rank == 1:
    print("rank 1 leaves", flush=True)
    os._exit(0)
time.sleep(1)
start = time.monotonic()
try:
    comm.all_reduce(torch.ones(1024, device=info.device), mesh, "ulysses")
    torch.cuda.synchronize(info.device)  # NCCL work is asynchronous: wait for it here
except Exception as error:  # noqa: BLE001 (any error is the expected outcome; it is printed)
    print(f"rank 0 raised after {time.monotonic() - start:.0f} s: {type(error).__name__}: {error}"[:400], flush=True)
    sys.exit(3)
print(f"rank 0 finished an all-reduce without its peer after {time.monotonic() - start:.0f} s", flush=True)
sys.exit(0)
