"""diffusers DiT families under data, CFG, sequence and pipeline parallelism.

hooks.py      the machinery every strategy shares (batch split, hooks, attention interception)
linear_attention.py  linear attention (Sana's) as our processor: its sums over tokens the strategy's
row_halo.py   a convolution over token rows under sequence shards: each rank's band with its neighbours' rows
sequence.py   token strategy: one contiguous shard per sequence-parallel rank (ulysses × ring)
pipefusion/   token strategy: a PipeFusion stage, patch by patch on stale K/V, and its two schedules
step.py       one denoising step as one transformer call (every strategy's, PipeFusion's drained)
cache.py      StepCache: skip the blocks after the first, one decision agreed by every rank
dbcache.py    StepCache(method="dbcache"): front and back blocks always run, the middle by the same decision,
              with a TaylorSeer calibrator
diffusers_cache.py  diffusers' own cache hooks (First-Block Cache, TaylorSeer, MagCache, PAB) after
              parallelize, one decision for every rank
sharded_weights.py  torch's FSDP2 over the ranks that hold the same weights (shard_weights=True),
              and the closed form of its gathered bytes
offload.py    offload_blocks: the weights in host memory, N blocks at a time on the device (diffusers' group
              offloading, after parallelize)
parallel.py   parallelize(transformer, config, compile=False): the entry, and what compile cannot take;
              unparallelize undoes it
installed.py  Installed: every hook and replacement parallelize installs, by name, and their removal
strategy.py   the token strategy's interface (TokenStrategy), what a step is handed (StepContext), what
              a strategy reports (StrategyReport), the deliberately wrong variants a model is given (Controls)
"""

from ..accelerations import StepCache
from .cache import kept_block_names
from .hooks import ParallelState, local_mixing_layers, other_traffic_sizes, parallel_state
from .offload import offload_blocks, offload_groups
from .parallel import parallelize, unparallelize
from .pipefusion import PipeFusionStage
from .sequence import SequenceShards
from .sharded_weights import ShardedWeights, shard_text_encoder, shard_weights, weight_gather_bytes, weight_units
from .strategy import Controls, StepContext, StrategyReport, TokenStrategy

__all__ = [
    "StepCache",
    "kept_block_names",
    "ParallelState",
    "parallel_state",
    "local_mixing_layers",
    "other_traffic_sizes",
    "parallelize",
    "unparallelize",
    "offload_blocks",
    "offload_groups",
    "PipeFusionStage",
    "SequenceShards",
    "Controls",
    "StepContext",
    "StrategyReport",
    "TokenStrategy",
    "ShardedWeights",
    "shard_weights",
    "shard_text_encoder",
    "weight_gather_bytes",
    "weight_units",
]
