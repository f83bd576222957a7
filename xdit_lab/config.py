"""ParallelConfig: the six parallel degrees, the rules they obey, and a cost model to rank them.

A hybrid-parallel run splits `world_size` ranks into a grid of
    dp × cfg × pipefusion × ring × ulysses × tp
tp (tensor parallelism, models/tensor_parallel.py) varies fastest: its ranks each hold 1/tp of every split linear
layer and all-reduce a block's activations twice per block, the most frequent and largest collectives of the grid,
so they get the nearest ranks (one NVLink island); Ulysses' all-to-alls, once per attention layer, come next.
Under PipeFusion each stage's blocks are split over its tp ranks: the rank of tp coordinate t of stage s hands its
patch activations (whole, after the rowwise all-reduce) to the rank of coordinate t of stage s+1, and keeps the
stale K/V of its own heads, 1/tp of a stage's buffer.
A grid without tp (tp=1) lays its ranks out exactly as before tp existed.
The most common mistake is arithmetic: the degrees do not multiply to the number of
processes. `validate()` names every broken rule at once and, on a world-size mismatch,
lists the configurations that do fit. `options()` enumerates every valid configuration and
ranks it with the cost model below.

Cost model (per rank, per denoising step and per image branch: the elements a rank sends, as
the ranks' own records count them; p = tokens per image, hs = hidden size, L = transformer
layers, P = parameter bytes, N = the method's degree):
    Ulysses      4(N-1)/N²·p·hs·L  q, k, v and out (1/N of the tokens each) cross once; a rank keeps
                                   1/N of each. The published table's 4/N counts the whole shard,
                                   which would rank Ulysses 2 below Ring 2 where they send the same.
                 (3(H-H_r) + (N-1)·H_r)/(N·H)·p·hs·L  with H heads that N does not divide: rank r
                                   attends H_r of them (ceil or floor of H/N), sends q, k, v of the
                                   others and o of its own; the busiest rank counts
    Ring         2(N-1)/N·p·hs·L   K and V shards (1/N each) travel N-1 hops of the ring (of H_r/H
                                   of the heads under Ulysses)
    PipeFusion   2·p·hs            one patch activation handed to the next stage, and back
    TP           4(N-1)/N·(p+T)·hs·L  two all-reduces of [p+T, hs] per layer (after attention's output projection
                                   and after the MLP's), each 2(N-1)/N of it out of a rank: tp_bytes_per_forward
                                   below, the exact model's own (traffic.py), over the image's p tokens and the T
                                   text tokens a joint layer carries beside them (text_tokens = T/p; 0 for cross
                                   attention); Ulysses and Ring then move 1/N of the heads. Work and parameters are
                                   1/N (the layers outside the blocks stay whole: the exact bytes are
                                   models/tensor_parallel.py's plan)
    CFG, DP      ~0                only the final noise prediction is gathered
    parameters   P per rank under sequence/CFG/data parallelism, P/N under PipeFusion, P/world sharded
    gathers      F·(S-1)/S·P/N     with shard_weights (FSDP2 over the S = world/N ranks that hold the
                                   same stage): every forward all-gathers the stage's weights again;
                                   F forwards per step (a PipeFusion stage runs one per patch past the
                                   warmup), in units of P (CostEstimate.gather_weights)
With comm_dtype (float8 on the wire) the Ulysses and Ring terms count (1 + 4/d)/e of their elements: a row
of d = head_dim elements travels as d float8 bytes and a float32 scale instead of d·e bytes (e = the model's
bytes per element, 2 for bfloat16), so comm_p_hs stays in elements of the model's dtype and comm_bytes stays
elements × e: with d = 128 and bfloat16, 0.516 of the elements. PipeFusion's, CFG's and DP's stay whole.
An uneven split of the heads leaves work_fraction (tokens per rank) as it is; the busiest Ulysses
rank attends ceil(H/N) of the H heads (8 of 30 under ulysses 4, not 7.5), which it does not count.
In a hybrid, Ring passes K/V that Ulysses has already split by heads (so ÷ulysses), Ulysses
works on the ring's share of the sequence (so ÷ring), and each PipeFusion stage holds
L/pipefusion layers. The model's batch is every prompt's rows, twice with guidance
([unconditional; conditional]); cfg 2 takes one half, and dp splits what is left by rows, as the
forward does (sharding.batch_rows), so a rank carries ceil(batch·branches / (cfg·dp)) rows, at
least one (a dp group without rows computes a stand-in). At batch 1 with guidance, dp 2 and cfg 2
therefore do the same work. Work and traffic scale with the rows. Communication is reported in
units of p·hs (elements), so the table needs no hidden size; pass `hidden_size` and `dtype_bytes`
to get bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

# The degrees, slowest-varying rank first; this order is used everywhere (fields, mesh, tables).
DP, CFG, PIPEFUSION, RING, ULYSSES, TP = "dp", "cfg", "pipefusion", "ring", "ulysses", "tp"
SCHEDULES = ("drained", "async")  # PipeFusion's schedules (ParallelConfig.pipefusion_schedule)
# What sequence parallelism's exchanges may carry instead of the model's dtype (ParallelConfig.comm_dtype,
# attention/wire.py): torch's dtype names. A row of head_dim elements travels as head_dim bytes and a scale.
COMM_DTYPES = ("float8_e4m3fn",)
SCALE_BYTES = 4  # the float32 scale beside each row (token × head) of float8 on the wire
# Every degree of the rank grid, slowest first: the CLI's table, the explorer's pickers and the planners offer each
# (tp only for a model whose family has a tp plan: options(tensor_parallel=True)).
GRID = (DP, CFG, PIPEFUSION, RING, ULYSSES, TP)
# The one short form of each degree, for compact names, tables and mesh coordinates: 'cfg2·pf2'.
SHORT = {DP: "dp", CFG: "cfg", PIPEFUSION: "pf", RING: "ring", ULYSSES: "ulysses", TP: "tp"}


class ParallelConfigError(ValueError):
    """A parallel configuration that cannot run; the message lists every violated rule."""


@dataclass(frozen=True)
class CostEstimate:
    work_fraction: float  # transformer compute per rank, in single-image forwards (lower is faster)
    comm_p_hs: float  # elements moved per rank per step, in units of p·hs
    params_fraction: float  # parameter bytes per rank, as a fraction of the whole model P
    gather_weights: float = 0.0  # weight bytes all-gathered per rank per step (shard_weights), in units of P

    def comm_bytes(self, seq_len: int, hidden_size: int, dtype_bytes: int = 2) -> float:
        return self.comm_p_hs * seq_len * hidden_size * dtype_bytes


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    cfg: int = 1
    pipefusion: int = 1
    ring: int = 1
    ulysses: int = 1
    tp: int = 1  # tensor parallelism: the transformer's linear layers split over this many ranks
    num_patches: int | None = None  # PipeFusion patches; None means one per stage
    warmup_steps: int = 1  # synchronous full-image steps before PipeFusion runs on stale K/V
    # "drained": every step empties the pipeline; "async": the next step's patches enter stage 0 while
    # the last stage finishes this one (session.py: what step() means then)
    pipefusion_schedule: str = "drained"
    vae_parallel: bool = True  # decode in row bands over the ranks that share an image (vae.py)
    # PipeFusion's blocks per stage, e.g. (10, 9, 9); None: balanced (sharding.stage_ranges). Every module
    # that needs a stage's blocks asks stage_ranges() below, so the split is decided in one place.
    stage_split: tuple[int, ...] | None = None
    # None: Ulysses' all-to-alls and Ring's K/V blocks carry the model's dtype (exact). "float8_e4m3fn":
    # they carry float8 with a float32 scale per token and head (attention/wire.py): about half of
    # bfloat16's bytes, an approximation measured per family (tests/test_fp8_comm.py)
    comm_dtype: str | None = None

    def __repr__(self) -> str:
        return f"ParallelConfig({self._fields()})"

    def __post_init__(self):
        if not isinstance(self.vae_parallel, bool):
            raise ParallelConfigError(f"vae_parallel must be True or False, got {self.vae_parallel!r}")
        for name in (*GRID, "warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ParallelConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.num_patches is not None and (
            not isinstance(self.num_patches, int) or isinstance(self.num_patches, bool)
        ):
            raise ParallelConfigError(f"num_patches must be an int or None, got {self.num_patches!r}")
        if self.stage_split is not None:
            split = self.stage_split
            if not isinstance(split, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in split
            ):
                raise ParallelConfigError(f"stage_split must be blocks per stage, a list of ints, got {split!r}")
            object.__setattr__(self, "stage_split", tuple(split))  # frozen: hashable, one spelling
        if self.pipefusion_schedule not in SCHEDULES:
            raise ParallelConfigError(
                f"pipefusion_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {self.pipefusion_schedule!r}"
            )

    # ---- derived sizes ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.cfg * self.pipefusion * self.ring * self.ulysses * self.tp

    @property
    def sp_degree(self) -> int:
        """Sequence-parallel degree: ranks that share one image's tokens within a stage."""
        return self.ulysses * self.ring

    @property
    def patches(self) -> int:
        return self.num_patches if self.num_patches is not None else self.pipefusion

    def spelled(self) -> str:
        """The product written out, e.g. 'cfg 2 × ulysses 2 = 4' (degrees of 1 left out)."""
        used = [f"{name} {getattr(self, name)}" for name in GRID if getattr(self, name) != 1]
        return f"{' × '.join(used) or 'serial'} = {self.world_size}"

    def short(self) -> str:
        """Compact form for tables: 'cfg2·pf2·ulysses2', 'pf2·async', or 'serial' (SHORT names each degree)."""
        used = [f"{SHORT[name]}{getattr(self, name)}" for name in GRID if getattr(self, name) != 1]
        if self.pipefusion_schedule != "drained":
            used.append(self.pipefusion_schedule)
        if self.comm_dtype is not None:
            used.append("fp8")
        return "·".join(used) or "serial"

    def replace(self, **changes) -> ParallelConfig:
        return dataclasses.replace(self, **changes)

    def stage_ranges(self, num_blocks: int) -> list[tuple[int, int]]:
        """[start, stop) of the blocks each PipeFusion stage holds, of a model with `num_blocks` stacked
        blocks: balanced, or as `stage_split` says (one range for pipefusion 1)."""
        from .sharding import stage_ranges

        return stage_ranges(num_blocks, self.pipefusion, None if self.stage_split is None else list(self.stage_split))

    # ---- rules ---------------------------------------------------------------------------
    def problems(
        self, world_size=None, *, num_heads=None, num_layers=None, seq_len=None, available_devices=None
    ) -> list[str]:
        """Every rule this configuration breaks, as sentences (empty when it is valid).

        `available_devices` (default: the visible GPUs) only shapes the advice on a world-size
        mismatch, e.g. "or run on 2 of your 4 GPUs"."""
        found = []
        below_one = [f"{name}={getattr(self, name)}" for name in GRID if getattr(self, name) < 1]
        if below_one:
            found.append(f"every degree must be at least 1, got {', '.join(below_one)}")
        if self.cfg not in (1, 2):
            found.append(f"cfg must be 1 or 2 (the unconditional and conditional branch), got {self.cfg}")
        if self.warmup_steps < 0:
            found.append(f"warmup_steps must be 0 or more, got {self.warmup_steps}")
        if self.num_patches is not None and self.num_patches < max(self.pipefusion, 1):
            found.append(
                f"num_patches {self.num_patches} is below the {self.pipefusion} PipeFusion stages: "
                f"every stage needs a patch in flight; use num_patches >= {self.pipefusion}"
            )
        if self.stage_split is not None and (len(self.stage_split) != self.pipefusion or min(self.stage_split) < 1):
            found.append(
                f"stage_split {list(self.stage_split)} must give each of the {self.pipefusion} PipeFusion stages "
                f"at least one block: {self.pipefusion} counts of 1 or more"
            )
        if self.comm_dtype is not None and self.comm_dtype not in COMM_DTYPES:
            found.append(
                f"comm_dtype {self.comm_dtype!r} is not a format the exchanges can carry; use "
                f"{' or '.join(map(repr, COMM_DTYPES))}, or None (the model's dtype, exact)"
            )
        elif self.comm_dtype is not None and self.pipefusion > 1 and self.sp_degree > 1:
            found.append(
                f"comm_dtype {self.comm_dtype!r} quantizes the exchanges of sequence shards, not of PipeFusion's "
                f"stale attention (pipefusion {self.pipefusion} with ulysses {self.ulysses} × ring {self.ring}); "
                f"use pipefusion 1, ulysses 1 and ring 1, or comm_dtype None"
            )
        if self.pipefusion_schedule == "async" and self.pipefusion < 2:
            found.append(
                f"pipefusion_schedule='async' overlaps PipeFusion stages across steps, but pipefusion is "
                f"{self.pipefusion}; use pipefusion >= 2 or the default schedule"
            )
        if self.tp > 1 and self.pipefusion > 1 and self.pipefusion_schedule == "async":
            found.append(
                f"tp {self.tp} is composed with PipeFusion's drained schedule, not yet with "
                f"pipefusion_schedule='async'; use the drained schedule with tp, or tp 1 with the async one"
            )
        if self.tp > 1 and self.comm_dtype is not None:
            found.append(
                f"comm_dtype {self.comm_dtype!r} is not composed with tp {self.tp} yet; use comm_dtype None (tp's "
                f"all-reduces and the sequence exchanges in the model's dtype) or tp 1"
            )
        if below_one:  # the size rules below need positive degrees
            return found
        if num_heads is not None and self.tp > 1 and num_heads % self.tp:
            fits = [n for n in range(2, num_heads + 1) if num_heads % n == 0]
            found.append(
                f"{num_heads} attention heads do not split over tp {self.tp} (each tp rank attends whole heads of its "
                f"own); use tp in {fits or [1]}"
            )
        elif num_heads is not None and self.tp > 1 and num_heads // self.tp < self.ulysses:
            found.append(
                f"the {num_heads // self.tp} heads of each tp {self.tp} rank cannot give each of ulysses "
                f"{self.ulysses} ranks a head; use ulysses <= {num_heads // self.tp} (ring for the rest)"
            )
        if num_heads is not None and num_heads < self.ulysses:  # any count splits, one head per rank at least
            found.append(
                f"{num_heads} attention heads cannot give each of ulysses {self.ulysses} ranks a head; "
                f"use ulysses <= {num_heads} (ring for the rest of the sequence parallelism)"
            )
        if num_layers is not None and self.stage_split is not None and sum(self.stage_split) != num_layers:
            found.append(
                f"stage_split {list(self.stage_split)} holds {sum(self.stage_split)} blocks, but the model has "
                f"{num_layers}; make the counts add up to {num_layers}"
            )
        if num_layers is not None and num_layers < self.pipefusion:
            found.append(
                f"{num_layers} transformer layers cannot fill {self.pipefusion} PipeFusion stages; "
                f"use pipefusion <= {num_layers}"
            )
        if seq_len is not None:
            tokens_per_patch_shard = self.patches * self.sp_degree
            if seq_len < tokens_per_patch_shard:
                found.append(
                    f"{seq_len} image tokens cannot give each of {self.patches} patch(es) × "
                    f"{self.sp_degree} sequence-parallel ranks a token"
                )
        if world_size is not None and world_size != self.world_size:
            found.append(self._world_size_message(world_size, available_devices, num_heads, num_layers, seq_len))
        return found

    def validate(
        self, world_size=None, *, num_heads=None, num_layers=None, seq_len=None, available_devices=None
    ) -> ParallelConfig:
        """Raise ParallelConfigError naming every violated rule; return self when valid."""
        found = self.problems(
            world_size, num_heads=num_heads, num_layers=num_layers, seq_len=seq_len, available_devices=available_devices
        )
        if found:
            lines = "\n".join(f"  - {p}" for p in found)
            raise ParallelConfigError(f"ParallelConfig({self._fields()}) cannot run:\n{lines}")
        return self

    def _fields(self) -> str:
        """The fields as keyword arguments; tp, vae_parallel, pipefusion_schedule, stage_split and comm_dtype only
        when not their default."""
        quiet = {"tp", "vae_parallel", "pipefusion_schedule", "stage_split", "comm_dtype"}
        fields = [f for f in dataclasses.fields(self) if f.name not in quiet or getattr(self, f.name) != f.default]
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields)

    def _world_size_message(self, world_size, available_devices, num_heads, num_layers, seq_len) -> str:
        devices = available_devices if available_devices is not None else _visible_gpus()
        unit = "GPUs" if available_devices is None else "devices"
        shape = dict(num_heads=num_heads, num_layers=num_layers, seq_len=seq_len)
        text = f"the degrees multiply to {self.spelled()} ranks, but the world size is {world_size}."
        fits = [c.short() for c in ParallelConfig.options(world_size, **shape)] if world_size >= 1 else []
        if fits:
            shown = ", ".join(fits[:8]) + (f" and {len(fits) - 8} more" if len(fits) > 8 else "")
            text += f" Configurations that fit {world_size} ranks (best first): {shown}"
            text += f", or run on {world_size} of your {devices} {unit}." if devices > world_size else "."
        if self.problems(num_heads=num_heads, num_layers=num_layers, seq_len=seq_len):
            return text  # no advice to keep it: the model refuses it whatever the ranks (said beside this)
        if self.world_size < world_size:
            text += (
                f" A smaller configuration may run on a subset of the devices: this one can run on "
                f"{self.world_size} of your {world_size} ranks (RankMesh uses the first "
                f"{self.world_size}; the others stay idle)."
            )
        elif devices >= self.world_size:
            text += (
                f" Or keep this configuration and launch {self.world_size} ranks: you have {devices} {unit} "
                f"(torchrun --nproc_per_node {self.world_size})."
            )
        else:
            text += (
                f" Or keep this configuration on {self.world_size} ranks (torchrun --nproc_per_node {self.world_size})."
            )
        return text

    # ---- cost model and enumeration ---------------------------------------------------------
    def cost(
        self,
        num_layers: int | None = None,
        *,
        num_heads: int | None = None,
        batch: int = 1,
        use_cfg: bool = True,
        shard_weights: bool = False,
        forwards_per_step: int | None = None,
        head_dim: int = 128,
        dtype_bytes: int = 2,
        text_tokens: float = 0.0,
    ) -> CostEstimate:
        """Per-rank work, communication and parameter share of one denoising step (table above).

        `batch` prompts, each run twice (unconditional and conditional) when `use_cfg`. The rows
        are split over cfg, then dp, exactly as the forward splits them: the busiest rank's rows
        count (tests/test_cost_model.py counts them on real ranks). With `shard_weights` (FSDP2
        over the world / pipefusion ranks that hold the same blocks), `gather_weights` counts the
        weights a rank all-gathers per step: (S-1)/S of its stage's share for each of
        `forwards_per_step` forwards (default: one, or one per patch under PipeFusion). `num_heads`: the
        model's attention heads, for Ulysses degrees that do not divide them (None: as if they did). `head_dim`
        and `dtype_bytes` (the model's) weigh float8 on the wire against the model's dtype, with comm_dtype.
        `text_tokens`: the text tokens per image token that tp's all-reduces carry beside the image's (T/p: a
        joint layer's text stream, a single-stream block's [text; image]); 0 for cross attention."""
        layers = num_layers if num_layers is not None else 28  # DiT-XL / PixArt depth
        branches = 2 if (use_cfg or self.cfg == 2) else 1
        images_per_rank = max(1, -(-(batch * branches) // (self.cfg * self.dp)))
        u, r, n, t = self.ulysses, self.ring, self.pipefusion, self.tp
        # each Ulysses rank's share of the heads (H_r / H); the busiest rank's traffic counts
        # (floor and ceil of H/u: sharding.shard_sizes's split, spelled here without importing torch)
        shares = (
            [1 / u]
            if num_heads is None or num_heads % u == 0
            else [num_heads // u / num_heads, (num_heads // u + 1) / num_heads]
        )
        # the Ulysses and Ring exchanges' bytes per element of the model's dtype: float8 and its scales
        wire = 1.0 if self.comm_dtype is None else (1 + SCALE_BYTES / head_dim) / dtype_bytes
        per_image = 0.0
        by_share = []
        for share in shares:
            sent = 0.0
            if u > 1:  # q, k, v of the other heads, o of its own, for 1/(u·r) of the tokens
                sent += (3 * (1 - share) / u + share * (u - 1) / u) * (1 / r) * (layers / n)
            if r > 1:
                sent += 2 * ((r - 1) / r) * share * (layers / n)
            by_share.append(sent * wire)
        per_image += max(by_share) / t  # a tp rank's Ulysses and Ring move its 1/t of the heads
        if t > 1:  # two all-reduces per layer of this rank's tokens (1/(u·r) of the image's and the text's) × hs
            per_image += tp_bytes_per_forward(t, 1, reduced=[2 * (1 + text_tokens) / (u * r) * (layers / n)])
        if n > 1:
            per_image += 2 / (u * r)
        shards = self.world_size // (n * t)  # ranks that hold the same stage's weights
        gather = 0.0
        if shard_weights and shards > 1:
            forwards = forwards_per_step if forwards_per_step is not None else (self.patches if n > 1 else 1)
            gather = forwards * (shards - 1) / shards / n
        return CostEstimate(
            work_fraction=images_per_rank / (u * r * n * t),
            comm_p_hs=images_per_rank * per_image,
            params_fraction=1 / (n * t * shards) if shard_weights else 1 / (n * t),
            gather_weights=gather,
        )

    @staticmethod
    def options(
        world_size,
        *,
        num_heads=None,
        num_layers=None,
        seq_len=None,
        use_cfg=True,
        batch=1,
        num_patches=None,
        warmup_steps=1,
        comm_dtype=None,
        tensor_parallel=False,
    ) -> list[ParallelConfig]:
        """Every valid configuration for `world_size` ranks, best first.

        `tensor_parallel`: tp degrees too, for a model whose family has a tp plan (models/tensor_parallel.py), within
        PipeFusion's stages as beside the sequence degrees; by default the five other degrees only, as for a model
        tp cannot split.

        `comm_dtype` (float8 on the wire) is given to every configuration whose Ulysses or Ring links can
        carry it; the others (no sequence parallelism, or PipeFusion with it) are listed without it.

        Ranked by the cost model for `batch` prompts: least compute per rank (the speed-up), then
        least communication per rank per step, then least parameter memory per rank, then fewest
        parallel dimensions (simpler to run and to debug). `use_cfg=False` (no guidance) leaves
        out cfg 2."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ParallelConfigError(f"world_size must be a positive int, got {world_size!r}")
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        found = []
        tps = divisors if tensor_parallel else (1,)
        for dp, cfg, pipefusion, ring, tp in itertools.product(
            divisors, (1, 2) if use_cfg else (1,), divisors, divisors, tps
        ):
            rest, leftover = divmod(world_size, dp * cfg * pipefusion * ring * tp)
            if leftover or rest < 1:
                continue
            patches = None if num_patches is None else max(num_patches, pipefusion)
            config = ParallelConfig(
                dp=dp,
                cfg=cfg,
                pipefusion=pipefusion,
                ulysses=rest,
                ring=ring,
                tp=tp,
                num_patches=patches,
                warmup_steps=warmup_steps,
            )
            if comm_dtype is not None and config.sp_degree > 1 and not config.replace(comm_dtype=comm_dtype).problems():
                config = config.replace(comm_dtype=comm_dtype)
            if not config.problems(world_size, num_heads=num_heads, num_layers=num_layers, seq_len=seq_len):
                found.append(config)

        return sorted(found, key=lambda c: rank_key(c, num_layers, batch=batch, use_cfg=use_cfg, num_heads=num_heads))


# Why a configuration ranks above the next one, by the first figure of rank_key that differs.
_RANKED_BY = (
    "less compute per rank than {}",
    "as much compute, less traffic per rank than {}",
    "the same compute and traffic as {}, fewer weights per rank",
    "the same cost as {}, fewer degrees above 1 (simpler to run)",
)
_TIES = (  # then the degrees: less dp, more cfg, more Ulysses (fast links), more Ring
    "ties with {}: less dp (preferred last)",
    "ties with {}: more cfg",
    "ties with {}: more Ulysses (its all-to-alls stay on the fast links)",
    "ties with {}: more Ring",
)


def rank_key(config: ParallelConfig, num_layers=None, *, batch=1, use_cfg=True, num_heads=None) -> tuple:
    """What options() sorts by: compute per rank, then traffic, then parameter share, then the
    number of degrees above 1; remaining ties prefer cfg, then Ulysses (fast links), over dp."""
    cost = config.cost(num_layers, num_heads=num_heads, batch=batch, use_cfg=use_cfg)
    dims = sum(getattr(config, n) > 1 for n in GRID)
    return (
        round(cost.work_fraction, 9),
        round(cost.comm_p_hs, 9),
        cost.params_fraction,
        dims,
        config.dp,
        -config.cfg,
        -config.ulysses,
        -config.ring,
    )


def ranking_reasons(configs, num_layers=None, *, batch=1, use_cfg=True, num_heads=None) -> list[str]:
    """Why each configuration of a ranked list (options()) sits above the next one: the first figure
    of rank_key in which the two differ, named ('' for the last)."""
    keys = [rank_key(c, num_layers, batch=batch, use_cfg=use_cfg, num_heads=num_heads) for c in configs]
    reasons = []
    for i, (key, below) in enumerate(zip(keys, keys[1:])):
        first = next((j for j, (a, b) in enumerate(zip(key, below)) if a != b), len(key))
        reasons.append((*_RANKED_BY, *_TIES, "the same as {}")[first].format(configs[i + 1].short()))
    return reasons + [""] * bool(configs)


def tp_bytes_per_forward(tp: int, dtype_bytes: int, *, reduced, gathered=(), norm_rows=()) -> int | float:
    """Bytes out of one rank of a tp group of N = `tp` in one forward of the transformer (models/tensor_parallel.py),
    per collective as comm counts it (its direct model, floored per call):
      reduced    each rowwise layer's output [b, tokens, width] (its elements here), all-reduced: 2·(N-1)/N of its
                 bytes, twice a block (attention's output projection, the MLP's last layer; a joint block's text
                 stream twice more)
      gathered   each split modulation's whole output [b, width] (elements): this rank's columns, 1/N of them, to
                 N-1 peers
      norm_rows  each norm over every head (Wan's): its float32 sums of squares [b, tokens] (elements) all-reduced
    A rank's tokens are its sequence shard's under ulysses or ring (and the text's shard where it is cut). The one
    closed form of tp's traffic: the exact model (traffic.expected_bytes_per_step) gives it whole counts of
    elements, the cost model (ParallelConfig.cost) fractions of p·hs, which are not floored."""
    n, e = tp, dtype_bytes
    if n == 1:
        return 0

    def share(sent, parts):  # a whole count floored per call, as comm records it; a fraction as it is
        return sent // parts if isinstance(sent, int) else sent / parts

    return (
        sum(share(2 * elements * e * (n - 1), n) for elements in reduced)
        + sum(share(elements, n) * e * (n - 1) for elements in gathered)
        + sum(share(2 * elements * 4 * (n - 1), n) for elements in norm_rows)
    )


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install must not hide the configuration error
        return 0
