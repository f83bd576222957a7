"""What this Python environment can run: `python -m xdit_lab.env` (make setup prints it).

    torch 2.11.0+cu130 (built for CUDA 13.0), CUDA usable: yes, 1 GPU
      cuda:0  NVIDIA H200  capability 9.0  150.1 GB
    attention kernels (head_dim 64): float16 flash_attn, bfloat16 flash_attn, float32 sdpa_efficient
    flash-attn 2.8.3

A GPU that nvidia-smi sees but torch cannot use is said out loud, with the usual causes: a CPU
build of torch, or a CUDA build newer than the driver. `--require-cuda` exits 1 then.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def report() -> tuple[list[str], bool]:
    """Lines describing torch, its CUDA, the GPUs and the attention kernels; and whether CUDA is usable."""
    import torch

    from .attention.local import attention_backend

    built_for = torch.version.cuda
    usable = torch.cuda.is_available() and torch.cuda.device_count() > 0
    lines = [
        f"torch {torch.__version__} ({'built for CUDA ' + built_for if built_for else 'CPU build'}), "
        f"CUDA usable: {'yes, ' + str(torch.cuda.device_count()) + ' GPU(s)' if usable else 'no'}"
    ]
    if usable:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(
                f"  cuda:{index}  {props.name}  capability {props.major}.{props.minor}  "
                f"{props.total_memory / 1e9:.1f} GB"
            )
        kernels = {
            str(dtype).replace("torch.", ""): attention_backend("cuda", dtype, 64)
            for dtype in (torch.float16, torch.bfloat16, torch.float32)
        }
        lines.append("attention kernels (head_dim 64): " + ", ".join(f"{k} {v}" for k, v in kernels.items()))
    else:
        seen = _nvidia_smi_gpus()
        if seen and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
            lines.append(f"nvidia-smi sees {len(seen)} GPU(s), hidden from this process (CUDA_VISIBLE_DEVICES='')")
        elif seen:
            why = (
                "this torch is a CPU build"
                if not built_for
                else f"this torch is built for CUDA {built_for}; the driver may be older than that"
            )
            lines.append(
                f"WARNING: nvidia-smi sees {len(seen)} GPU(s) ({seen[0]}) but torch cannot use them: {why}. "
                f"Install a torch built for your driver, e.g. make setup TORCH='torch==2.5.1' "
                f"TORCH_INDEX=https://download.pytorch.org/whl/cu121 (see README: On a CUDA machine)"
            )
        lines.append("attention kernels: cpu_flash on CPU tensors")
    try:
        import flash_attn

        lines.append(f"flash-attn {flash_attn.__version__}")
    except ImportError:
        lines.append("flash-attn not installed (optional: README, On a CUDA machine)")
    return lines, usable


def _nvidia_smi_gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    lines, usable = report()
    print("\n".join(lines))
    if "--require-cuda" in argv and not usable:
        print("CUDA is not usable here (--require-cuda)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
