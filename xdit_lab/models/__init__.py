"""diffusers DiT families under data, CFG, sequence and pipeline parallelism.

families.py   one adapter per family: where to shard and gather, attention kinds, its block stack
hooks.py      the machinery every strategy shares (batch split, hooks, attention interception)
sequence.py   token strategy: one contiguous shard per sequence-parallel rank (ulysses × ring)
pipefusion.py token strategy: a PipeFusion stage, patch by patch on stale K/V
cache.py      StepCache: skip the blocks after the first, one decision agreed by every rank
sharded_weights.py  torch's FSDP2 over the ranks that hold the same weights (shard_weights=True), and
              the closed form of its gathered bytes
parallel.py   parallelize(transformer, config, compile=False): the entry, and what compile cannot take
"""

from .cache import StepCache
from .families import FAMILIES, SUPPORTED_DIFFUSERS, adapter_for, check_diffusers_version
from .hooks import ParallelState, parallel_state
from .parallel import compile_problems, parallelize
from .pipefusion import PipeFusionStage
from .sequence import SequenceShards
from .sharded_weights import ShardedWeights, shard_text_encoder, shard_weights, weight_gather_bytes, weight_units

__all__ = [
    "StepCache",
    "FAMILIES",
    "SUPPORTED_DIFFUSERS",
    "adapter_for",
    "check_diffusers_version",
    "ParallelState",
    "parallel_state",
    "parallelize",
    "compile_problems",
    "PipeFusionStage",
    "SequenceShards",
    "ShardedWeights",
    "shard_weights",
    "shard_text_encoder",
    "weight_gather_bytes",
    "weight_units",
]
