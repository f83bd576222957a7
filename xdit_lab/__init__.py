"""xdit_lab: hybrid-parallel inference of Diffusion Transformers, from notebook cells to torchrun.

The light pieces (configuration, mesh, communication) import at once; the ones that pull in
diffusers' pipelines, and the notebook Lab (ipyparallel), load on first use, so `xdit-lab plan` starts in a
moment."""

import importlib

from .comm import CommLog, CommRecord, comm_log
from .config import CostEstimate, ParallelConfig, ParallelConfigError
from .distributed import init_distributed, shutdown_distributed
from .mesh import RankMesh
from .quantization import drop_false_alarms

drop_false_alarms()  # log lines that torchao's presence prints on every pipeline load (see quantization.py)

__version__ = "0.1.0"

_LAZY = {
    "attention_backend": "attention",
    "set_attention_backend": "attention",
    "sp_attention": "attention",
    "parallelize": "models",
    "unparallelize": "models",
    "StepCache": "models",
    "LoadOptions": "load_options",
    "ParallelPipeline": "pipeline",
    "load_pipeline": "pipeline",
    "DenoiseSession": "session",
    # the notebook Lab: xdit_lab.lab is itself lazy, so ipyparallel loads on the first use of Lab, not here
    "Lab": "lab",
    "LabSession": "lab",
    "LabError": "lab",
}

__all__ = [
    "CommLog",
    "CommRecord",
    "comm_log",
    "CostEstimate",
    "ParallelConfig",
    "ParallelConfigError",
    "init_distributed",
    "shutdown_distributed",
    "RankMesh",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'xdit_lab' has no attribute {name!r}")
