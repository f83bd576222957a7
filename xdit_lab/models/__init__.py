"""diffusers DiT families under data, CFG and sequence parallelism."""

from .families import FAMILIES, SUPPORTED_DIFFUSERS, adapter_for, check_diffusers_version
from .parallel import parallelize

__all__ = ["FAMILIES", "SUPPORTED_DIFFUSERS", "adapter_for", "check_diffusers_version", "parallelize"]
