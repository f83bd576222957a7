"""PipeFusion: this rank runs one stage of the blocks, patch by patch, on partly stale K/V.

Each of N stages holds L/N contiguous blocks (`ParallelConfig.stage_split` overrides the balanced
split); the image's tokens are cut into M patches (row bands). Stage s runs patch p as soon as stage
s-1 hands it over, so N stages work on N different patches at once and only patch activations cross
between stages:

    time →        t0        t1        t2        t3
    stage 0    patch 0   patch 1   patch 2   patch 3
    stage 1              patch 0   patch 1   patch 2   patch 3

When a patch attends, the K/V of patches not yet processed in this step are the previous step's
(attention/stale.py keeps them). The first `warmup_steps` run the whole image at once, so every
K/V is fresh; with warmup_steps >= num_inference_steps the result equals serial attention.

    stage.py       PipeFusionStage: the token strategy (what a stage holds, hands over and keeps)
    schedules.py   what a denoising step runs: drained (one call, the pipeline empties) or async
                   (the next step's patches enter stage 0 while the last stage finishes this one;
                   AsyncSchedule, owned by the stage, keeps its bookkeeping)
"""

from .schedules import NOISY_SCHEDULERS, AsyncSchedule, check_patchwise_scheduler
from .stage import STALE_KINDS, PipeFusionStage

__all__ = ["NOISY_SCHEDULERS", "STALE_KINDS", "AsyncSchedule", "PipeFusionStage", "check_patchwise_scheduler"]
