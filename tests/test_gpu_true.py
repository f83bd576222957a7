"""The CUDA/NCCL path made right on paper, checked on CPU wherever its logic runs there (issue 15).

Each test names what went wrong before: diffusers' attention backends bypassing the parallel
kernels, forced kernels that cannot run, host syncs in Ring's merge, groups without the world's
timeout or never destroyed, models kept alive by their own forward, PipeFusion's message order
and dtypes, and the Lab's engine count on a GPU host. What needs a GPU is in tests/gpu/."""

import gc
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xdit_lab import ParallelConfig, RankMesh, comm, parallelize
from xdit_lab.attention import local_attention, merge_attention, set_attention_backend, sp_attention
from xdit_lab.attention.local import attention_backend, why_not
from xdit_lab.lab.cluster import engine_plan
from xdit_lab.mesh import GROUP_NAMES
from xdit_lab.sharding import take_shard
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_inputs, tiny_pipeline_kwargs, tiny_transformer

REPO = Path(__file__).resolve().parents[1]


# ---- diffusers' attention backends: refused or exact, never a shard-only result ----------------------

def test_backend_fallback_rules():
    cpu = [attention_backend("cpu", dtype, head_dim) for dtype in (torch.float32, torch.bfloat16, torch.float16)
           for head_dim in (16, 20, 72, 300)]
    assert set(cpu) == {"cpu_flash"}

    def cuda(dtype, head_dim, capability, flash_attn=False):
        from xdit_lab.attention.local import _decide

        return _decide("cuda", dtype, head_dim, capability, flash_attn, None)

    hopper, turing = (9, 0), (7, 5)
    assert cuda(torch.bfloat16, 64, hopper, flash_attn=True) == "flash_attn"
    assert cuda(torch.bfloat16, 72, hopper) == "sdpa_flash"
    assert cuda(torch.float32, 64, hopper, flash_attn=True) == "sdpa_efficient"  # flash kernels: half only
    assert cuda(torch.float16, 20, hopper) == "math"  # torch's flash op: head_dim % 8; efficient: same alignment
    assert cuda(torch.float16, 64, turing) == "sdpa_efficient"  # flash kernels need Ampere
    assert cuda(torch.bfloat16, 64, turing) == "math"  # and so does bf16 in the efficient kernel
    assert cuda(torch.float16, 320, hopper) == "sdpa_efficient"  # beyond the flash kernels' 256
    assert cuda(torch.float16, 300, hopper) == "math"
    assert "Ampere" in why_not("sdpa_flash", "cuda", torch.float16, 64, turing)
    assert "multiple of 8" in why_not("sdpa_flash", "cuda", torch.float16, 20, hopper)
    assert "not installed" in why_not("flash_attn", "cuda", torch.float16, 64, hopper, flash_attn_installed=False)


@pytest.mark.parametrize("forced", ["sdpa_flash", "sdpa_efficient", "flash_attn"])
def test_a_forced_backend_that_cannot_run_raises_saying_why(forced, monkeypatch):
    """Before: a forced backend skipped every check and reached a CUDA-only op with CPU tensors."""
    q = torch.randn(1, 2, 6, 8)
    monkeypatch.setenv("XDIT_LAB_ATTENTION", forced)
    with pytest.raises(ValueError, match=f"'{forced}' is forced .* cannot run float32 tensors with head_dim 8 on "
                                         f"cpu: it needs CUDA tensors.*Backends that can: cpu_flash, math"):
        local_attention(q, q, q)
    monkeypatch.delenv("XDIT_LAB_ATTENTION")
    try:
        set_attention_backend(forced)
        with pytest.raises(ValueError, match="cannot run"):
            local_attention(q, q, q)
        set_attention_backend("math")  # a forced backend that can run does
        out, _ = local_attention(q, q, q)
    finally:
        set_attention_backend(None)
    assert (out - F.scaled_dot_product_attention(q, q, q)).abs().max() < 1e-6
