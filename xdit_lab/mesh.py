"""RankMesh: the one object that owns the process groups of a ParallelConfig.

Ranks are laid out as a grid dp × cfg × pipefusion × ring × ulysses × tp with tp varying fastest,
then ulysses (xDiT's tp-sp-pp-cfg-dp order): tp's all-reduces (two per block) and Ulysses' all-to-alls
stay on neighbouring ranks, the fast links of a GPU box, while Ring and PipeFusion, which pass
point-to-point messages, go further. A grid with tp 1 is the grid without tp, rank for rank.
For 8 ranks with ulysses 2, ring 2, cfg 2:

    rank:     0 1 2 3 4 5 6 7
    ulysses:  0 1 0 1 0 1 0 1
    ring:     0 0 1 1 0 0 1 1
    cfg:      0 0 0 0 1 1 1 1

Groups are made here and nowhere else. Every rank of the world must build the mesh (torch's
`new_group` is collective); a configuration smaller than the world runs on its first
`config.world_size` ranks and the rest are idle (`mesh.active` is False there). PipeFusion's
point-to-point messages travel on links: one two-rank communicator per direction between neighbouring
stages (`link(src, dst)`), so that no message waits behind another direction's (see `_build_links`).
Each group gets the world's timeout (a lost peer raises after it, not after NCCL's default), and `close()`
destroys them: every reconfiguration makes a new mesh, and NCCL communicators hold GPU memory
until destroyed.
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

from . import comm
from .config import CFG, DP, GRID, PIPEFUSION, RING, SHORT, TP, ULYSSES, ParallelConfig, ParallelConfigError
from .distributed import current_info

# Named groups: the six degrees, SP (the ring × ulysses ranks that share one image's tokens, of one tp
# coordinate: they hold the same columns of the weights), IMAGE (every rank that computes part of one
# image's tokens: PipeFusion stages × sp, the VAE decode's bands; each tp coordinate decodes its own copy),
# WORLD (every rank of the configuration, which may be a subset of the processes) and WEIGHTS (the ranks
# that hold the same weights: every degree but pipefusion and tp, so one PipeFusion stage's ranks of one tp
# coordinate; FSDP2 shards the transformer over it, models/sharded_weights.py). Code names a group by these
# constants; the strings are what comm records and views show.
SP, IMAGE, WORLD, WEIGHTS = "sp", "image", "world", "weights"
GROUP_NAMES = (*GRID, SP, IMAGE, WORLD, WEIGHTS)
_GROUP_DIMS = {name: (name,) for name in GRID} | {
    SP: (RING, ULYSSES),
    IMAGE: (PIPEFUSION, RING, ULYSSES),
    WORLD: GRID,
    WEIGHTS: (DP, CFG, RING, ULYSSES),
}
__all__ = [
    "RankMesh", "GROUP_NAMES", "DP", "CFG", "PIPEFUSION", "RING", "ULYSSES", "TP", "SP", "IMAGE", "WORLD", "WEIGHTS"
]  # fmt: skip


class RankMesh:
    def __init__(
        self,
        config: ParallelConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout_s: float | None = None,
    ):
        if rank is None or world_size is None:
            if not dist.is_initialized():
                raise RuntimeError("RankMesh needs torch.distributed: call xdit_lab.init_distributed() first")
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        self.check(config, world_size)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.active = rank < config.world_size
        self.shape = {name: getattr(config, name) for name in GRID}
        self.coords = self.coords_of(rank) if self.active else None
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._group_ranks: dict[str, list[int]] = {}
        self._made: list[dist.ProcessGroup] = []  # every group this process made, in order, for close()
        self._links: dict[tuple[int, int], dist.ProcessGroup] = {}  # (src, dst) -> PipeFusion's link src -> dst
        self._device_meshes: dict = {}  # (group name, device type) -> a 1-D DeviceMesh over it, for FSDP2
        self.closed = False
        self.handle = comm.handle(self)  # how a compiled graph's collectives find this mesh
        if dist.is_initialized():
            self._build_groups(current_info().timeout_s if timeout_s is None else timeout_s)

    @staticmethod
    def check(config: ParallelConfig, world_size: int | None = None, *, num_heads: int | None = None) -> None:
        """Refuse a configuration a mesh cannot be built from (ParallelConfig.problems), or one larger than
        `world_size` ranks (where given), naming every rule it breaks: a mesh's own check, which callers run before
        they read anything. The CLI runs it with torchrun's world size and the folder's heads (read as JSON)
        before it imports diffusers, so that what it advises fits them; load_pipeline without either before it
        reads the folder (it checks the world's size when it builds the mesh, after the model's own refusals)."""
        found = config.problems(num_heads=num_heads)
        if world_size is not None and config.world_size > world_size:
            found.append(config._world_size_message(world_size, None, num_heads, None, None))
        if found:
            raise ParallelConfigError("cannot build a RankMesh:\n" + "\n".join(f"  - {p}" for p in found))

    # ---- coordinates -------------------------------------------------------------------
    def coords_of(self, rank: int) -> dict[str, int]:
        """Grid coordinates of a rank, e.g. {'dp': 0, 'cfg': 1, 'pipefusion': 0, 'ring': 0, 'ulysses': 1, 'tp': 0}."""
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank {rank} is not in this mesh of {self.config.world_size} ranks")
        coords = {}
        for name in reversed(GRID):  # tp first: it varies fastest
            rank, coords[name] = divmod(rank, self.shape[name])
        return {name: coords[name] for name in GRID}

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (missing ones taken from this rank's)."""
        where = {**(self.coords or {}), **coords}
        rank = 0
        for name in GRID:
            rank = rank * self.shape[name] + where[name]
        return rank

    def __getattr__(self, name):
        # mesh.ulysses_rank, mesh.ring_rank, ... : this rank's coordinate in each dimension
        if name.endswith("_rank") and name[: -len("_rank")] in GRID:
            return self.coords[name[: -len("_rank")]] if self.coords else None
        raise AttributeError(name)

    # ---- groups --------------------------------------------------------------------------
    def all_groups(self, name: str) -> list[list[int]]:
        """All groups of one name, each a list of global ranks, in a fixed order (from the
        coordinates alone: no process group is needed)."""
        varying = _GROUP_DIMS[name]
        fixed = [d for d in GRID if d not in varying]
        groups = []
        for fixed_coords in itertools.product(*(range(self.shape[d]) for d in fixed)):
            base = dict(zip(fixed, fixed_coords))
            members = [
                self.rank_of(**base, **dict(zip(varying, vc)))
                for vc in itertools.product(*(range(self.shape[d]) for d in varying))
            ]
            groups.append(sorted(members))
        return groups

    def _build_groups(self, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        # Every process calls new_group for every group, in the same order (it is collective).
        for name in GROUP_NAMES:
            for members in self.all_groups(name):
                group = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
                if self.rank in members:
                    self._groups[name] = group
                    self._group_ranks[name] = members
                    if group is not None:
                        self._made.append(group)
        self._build_links(timeout)

    def all_links(self) -> list[tuple[int, int]]:
        """PipeFusion's links, each (src, dst) global ranks: stage s -> s+1 in every pipefusion group, and
        under the async schedule the last stage -> stage 0 (the latents going back). Empty at degree 1."""
        n = self.shape[PIPEFUSION]
        if n == 1:
            return []
        wrap = self.config.pipefusion_schedule == "async"
        return [
            (stages[s], stages[(s + 1) % n])
            for stages in self.all_groups(PIPEFUSION)  # in stage order: only pipefusion varies within one
            for s in range(n if wrap else n - 1)
        ]

    def _build_links(self, timeout) -> None:
        """One two-rank communicator per direction between neighbouring PipeFusion stages.

            stage     0 ──link 0→1──> 1 ──link 1→2──> 2        the patches' activations
                      ^                               │
                      └─────────── link 2→0 ──────────┘        async: a step's latents, back to stage 0

        NCCL runs one communicator's operations in the order they were posted. On one communicator for
        all of them, a middle stage's send of patch i would wait behind its receive of patch i+1 (posted
        first, so that it arrives while patch i computes), that is, until the previous stage has computed
        patch i+1; and a communicator over every stage is initialised by all of its ranks together, which
        a stage that never uses it never joins. On a link each rank only sends or only receives, in the
        order the other end posts the matching operations, and both ends use it."""
        for src, dst in self.all_links():
            group = dist.new_group(sorted((src, dst)), timeout=timeout)  # collective: every rank, same order
            if self.rank in (src, dst):
                self._links[src, dst] = group
                self._made.append(group)

    def close(self) -> None:
        """Destroy this mesh's process groups (their NCCL communicators and buffers). Safe to call
        twice, and after the world is gone; call it on every rank of the mesh, when nothing is in
        flight on its groups. Using the mesh's groups afterwards raises."""
        if self.closed:
            return
        self.closed = True
        made, self._made = self._made, []
        self._device_meshes.clear()  # they name our groups: released with them
        if not dist.is_initialized():
            return  # shutting the world down destroyed every group already
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # nothing queued may still use a communicator being destroyed
        for group in reversed(made):  # the same order on every rank
            try:
                dist.destroy_process_group(group)
            except ValueError:
                pass  # not registered any more: the world it belonged to was shut down and made again

    def group(self, name: str):
        """The process group of this rank for `name`, or None when its degree is 1."""
        self._check_name(name)
        group = self._groups.get(name)
        self._check_open(group)
        return group

    def p2p_group(self, name: str, src: int, dst: int):
        """The communicator a message of group `name` from global rank `src` to `dst` travels on (this rank
        is one of the two): PipeFusion's link of that direction, or the group's own communicator."""
        return self.link(src, dst) if name == PIPEFUSION else self.group(name)

    def link(self, src: int, dst: int):
        """The communicator of PipeFusion's messages from global rank `src` to `dst`, neighbouring stages
        (`_build_links`); this rank is one of the two."""
        self._check_name(PIPEFUSION)
        if (src, dst) not in self._links:
            raise ValueError(
                f"no PipeFusion link {src} -> {dst} on rank {self.rank}: links join stage s to s+1 (and, under "
                f"the async schedule, the last stage to stage 0) within one pipefusion group; this rank's are "
                f"{sorted(self._links) or 'none'}"
            )
        group = self._links[src, dst]
        self._check_open(group)
        return group

    def _check_open(self, group) -> None:
        if self.closed and group is not None:
            raise RuntimeError(
                f"this mesh ({self.config.short()}) was closed: its process groups are destroyed; "
                f"build a new RankMesh (or load the pipeline again)"
            )

    def device_mesh(self, name: str, device_type: str = "cpu"):
        """A 1-D torch DeviceMesh over this rank's group `name` (made once, cached; released by close()),
        for torch's own FSDP2 (`fully_shard(module, mesh=...)`), whose all-gathers then run on our group.
        None when the group is this rank alone. `device_type`: where the sharded parameters live
        ("cpu" over gloo, "cuda" over nccl)."""
        group = self.group(name)
        if group is None:
            return None
        if name in (WEIGHTS, TP) and self.group_size(WEIGHTS) > 1 and self.group_size(TP) > 1:
            return self._weights_by_tp(device_type)[name]
        key = (name, device_type)
        if key not in self._device_meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_meshes[key] = DeviceMesh.from_group(group, device_type, mesh_dim_names=(name,))
        return self._device_meshes[key]

    def _weights_by_tp(self, device_type: str):
        """The 2-D DeviceMesh [weights, tp] of this rank's weights and tp groups, whose two 1-D children FSDP2 and
        tensor parallelism use when both have several ranks: FSDP2 shards a tp-split DTensor parameter only over a
        mesh of the same root as the parameter's (torch's FSDP2 + TP layout). Row i, column j: the rank at index i
        of the weights group of tp coordinate j (the weights groups of a tp group's ranks differ only in tp)."""
        key = ((WEIGHTS, TP), device_type)
        if key not in self._device_meshes:
            from torch.distributed.device_mesh import DeviceMesh

            stride = self.rank_of(tp=1) - self.rank_of(tp=0)
            rows = [
                [rank + (j - self.coords[TP]) * stride for j in range(self.shape[TP])]
                for rank in self.group_ranks(WEIGHTS)
            ]
            self._device_meshes[key] = DeviceMesh.from_group(
                [self.group(WEIGHTS), self.group(TP)],
                device_type,
                mesh=torch.tensor(rows),
                mesh_dim_names=(WEIGHTS, TP),
            )
        return self._device_meshes[key]

    def group_ranks(self, name: str) -> list[int]:
        """Global ranks in this rank's group `name`, in group-rank order."""
        self._check_name(name)
        return self._group_ranks.get(name, [self.rank])

    def group_size(self, name: str) -> int:
        self._check_name(name)
        if name == SP:
            return self.config.sp_degree
        if name == IMAGE:
            return self.config.sp_degree * self.shape[PIPEFUSION]
        if name == WORLD:
            return self.config.world_size
        if name == WEIGHTS:
            return self.config.world_size // (self.shape[PIPEFUSION] * self.shape[TP])
        return self.shape[name]

    def group_rank(self, name: str) -> int:
        """This rank's index inside its group `name` (for SP: ring-major, ulysses fastest; for IMAGE:
        stage-major, then ring, then ulysses)."""
        return self.group_ranks(name).index(self.rank)

    def _check_name(self, name: str):
        if name not in GROUP_NAMES:
            raise ValueError(f"unknown group {name!r}; groups are {', '.join(GROUP_NAMES)}")
        if not self.active:
            raise RuntimeError(f"rank {self.rank} is idle in this mesh of {self.config.world_size} ranks")

    # ---- pipeline neighbours -------------------------------------------------------------------
    @property
    def pipeline_prev(self) -> int:
        """Global rank of the previous PipeFusion stage (wrapping: stage 0's previous is the last)."""
        return self.rank_of(pipefusion=(self.coords[PIPEFUSION] - 1) % self.shape[PIPEFUSION])

    @property
    def pipeline_next(self) -> int:
        """Global rank of the next PipeFusion stage (the last stage's next is stage 0)."""
        return self.rank_of(pipefusion=(self.coords[PIPEFUSION] + 1) % self.shape[PIPEFUSION])

    @property
    def is_first_stage(self) -> bool:
        return self.coords[PIPEFUSION] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords[PIPEFUSION] == self.shape[PIPEFUSION] - 1

    def __str__(self) -> str:
        if not self.active:
            return f"idle (rank {self.rank} of {self.world_size}; the configuration uses {self.config.world_size})"
        shown = [name for name in GRID if name != TP or self.shape[TP] > 1]  # tp where the grid has it
        coords = " ".join(f"{SHORT[name]}{self.coords[name]}" for name in shown)
        return f"{coords} (rank {self.rank} of {self.config.world_size})"

    __repr__ = __str__
