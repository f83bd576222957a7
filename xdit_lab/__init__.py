"""xdit_lab: hybrid-parallel inference of Diffusion Transformers, from notebook cells to torchrun."""

from .attention import attention_backend, set_attention_backend, sp_attention
from .comm import CommLog, CommRecord, comm_log
from .config import CostEstimate, ParallelConfig, ParallelConfigError
from .distributed import init_distributed, shutdown_distributed
from .mesh import RankMesh
from .models import parallelize
from .pipeline import ParallelPipeline, load_pipeline
from .session import DenoiseSession

__version__ = "0.1.0"

__all__ = [
    "attention_backend", "set_attention_backend", "sp_attention",
    "CommLog", "CommRecord", "comm_log", "CostEstimate", "ParallelConfig", "ParallelConfigError",
    "init_distributed", "shutdown_distributed", "RankMesh", "parallelize",
    "ParallelPipeline", "load_pipeline", "DenoiseSession",
]
