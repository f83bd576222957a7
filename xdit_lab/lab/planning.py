"""What can run, and what runs best: the degree rules with a loaded model's own sizes.

    valid_configs(engines, shape)   every configuration for this Lab (fewer ranks leave the rest idle)
    explain(config, engines, shape) why one cannot run here
    plan(gpus, shape, batch=2)      planning mode: the configurations for GPUs the Lab does not have,
                                    ranked by the cost model, each with why it ranks above the next,
                                    and why each single degree of that size is refused

tp is a degree like the others here: ranked where the model's family has a tp plan (`ModelShape.tp_refused` says
why otherwise) and the load's options do not refuse it (`load_options`), at the degrees that divide its heads.

Pure functions over a ModelShape (the sizes the rules need, read from the loaded pipeline by the
explorer): tested without engines, and the explorer's panel only shows what they return.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import GRID, SHORT, ParallelConfig
from ..families.tp_plan import option_refusals
from ..plan_table import format_plan, plan_table


@dataclass(frozen=True)
class ModelShape:
    family: str
    num_heads: int
    num_layers: int
    rows: int  # image tokens per column, at the call's height
    cols: int
    use_cfg: bool  # the calls have two branches for cfg 2 to split (guidance > 1, for most families)
    hidden_size: int | None = None  # heads × head dim: the planning table's traffic in bytes
    cfg_needs: str | None = "a guidance_scale above 1"  # what gives a call two; None: never (the recipe's)
    tp_refused: str | None = None  # why tp cannot split this model (its family has no tp plan); None: it can
    # the load's options that tp may not be composed with yet, as option_refusals takes them (its quantization)
    load_options: dict | None = None

    @property
    def seq_len(self) -> int:
        return self.rows * self.cols


def valid_configs(engines: int, shape: ModelShape, *, num_patches=None, warmup_steps=1) -> list[ParallelConfig]:
    """Every configuration that runs on `engines` ranks or fewer (the rest idle): all ranks first,
    each world size best first by the cost model."""
    found = []
    for world in range(engines, 0, -1):
        found += [
            c
            for c in ParallelConfig.options(
                world,
                num_heads=shape.num_heads,
                num_layers=shape.num_layers,
                seq_len=shape.seq_len,
                use_cfg=shape.use_cfg,
                num_patches=num_patches,
                warmup_steps=warmup_steps,
                tensor_parallel=True,
            )
            if not _extra_problems(c, shape)
        ]
    return found


def explain(config: ParallelConfig, engines: int, shape: ModelShape) -> list[str]:
    """Why `config` cannot run on this Lab and model (empty when it can)."""
    # A smaller world is fine (idle ranks); only a larger one is a mismatch worth the long advice.
    world = engines if config.world_size > engines else None
    found = config.problems(
        world, num_heads=shape.num_heads, num_layers=shape.num_layers, seq_len=shape.seq_len, available_devices=engines
    )
    if world is not None:
        found.append(f"this Lab has {engines} engines: start Lab(n={config.world_size}) for this configuration")
    return found + _extra_problems(config, shape)


def _extra_problems(config: ParallelConfig, shape: ModelShape) -> list[str]:
    """Rules that depend on the model and the call, which ParallelConfig alone cannot know."""
    found = []
    if config.cfg == 2 and not shape.use_cfg:
        found.append(
            f"cfg 2 splits the unconditional and conditional branches, but {shape.family}'s pipeline has "
            "one (its guidance is the model's input); use cfg 1"
            if shape.cfg_needs is None
            else "cfg 2 splits the unconditional and conditional branches, but these calls have one; "
            f"give them {shape.cfg_needs}, or use cfg 1"
        )
    if config.tp > 1 and shape.tp_refused:
        found.append(shape.tp_refused)
    elif config.tp > 1 and shape.load_options:
        found += option_refusals(config, **shape.load_options)
    if config.pipefusion > 1 and config.patches > shape.rows:
        found.append(f"{config.patches} PipeFusion patches are row bands, but the image has {shape.rows} token rows")
    return found


def plan(gpus: int, shape: ModelShape, *, batch: int = 1) -> str:
    """The ranking for `gpus` ranks with this model (`xdit-lab plan --why`, with the model's heads,
    layers, tokens and hidden size): compute, traffic and weights per rank per step, why each row
    ranks above the next, then each degree alone at `gpus` that the model refuses, and why."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"plan for a positive number of GPUs, got {gpus!r}")
    rows, _ = plan_table(
        gpus,
        heads=shape.num_heads,
        layers=shape.num_layers,
        seq_len=shape.seq_len,
        hidden_size=shape.hidden_size,
        batch=batch,
        use_cfg=shape.use_cfg,
        top=0,
        reasons=True,
        tensor_parallel=True,
        # the call's own rules (guidance, patch rows, tp's plan) leave out what the degree rules alone allow
        keep=lambda config: not _extra_problems(config, shape),
    )
    lines = [
        f"{gpus} GPUs, {shape.family}: {shape.num_heads} heads, {shape.num_layers} layers, {shape.seq_len} image "
        f"tokens, {batch} prompt(s){', guidance on' if shape.use_cfg else ''}; {len(rows) - 1} configurations, best first",
        format_plan(rows) if len(rows) > 1 else "(none fits)",
    ]
    refused = []
    for name in (n for n in GRID if n != "cfg"):  # cfg is 1 or 2 whatever the model
        single = ParallelConfig(**{name: gpus})
        problems = single.problems(gpus, num_heads=shape.num_heads, num_layers=shape.num_layers, seq_len=shape.seq_len)
        problems += _extra_problems(single, shape) if not problems else []
        if problems and gpus > 1:
            refused.append(f"  {SHORT[name]}{gpus}: " + "; ".join(problems))
    if refused:
        lines += ["refused for this model:", *refused]
    lines.append(
        "work: transformer forwards per rank per step; comm: elements per rank per step in p·hs (bytes in bf16); "
        "params: share of the weights per rank; tp: only where the family has a tp plan and tp divides the heads "
        "(cost model: xdit_lab/config.py)"
    )
    return "\n".join(lines)


__all__ = ["ModelShape", "valid_configs", "explain", "plan"]
