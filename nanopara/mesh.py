"""The rank grid and its process groups.

Ranks are laid out as a grid [pp, dp, cp, tp] with tp fastest, so a tp group is a run of consecutive ranks and
stays inside one node on NVLink:

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

`Mesh.build(dp, pp, cp, tp)` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), initialises the default
process group (NCCL on CUDA, gloo on CPU) and creates one group per axis value plus the dp x cp group that reduces
gradients of replicated parameters; with `ep` > 1 also the expert-parallel groups ("ep": runs of ep ranks of the
dp x cp group, "edp": the ranks holding the same experts; mesh.ep, mesh.ep_rank, mesh.ep_group). Every rank
creates every group in the same order (a requirement of `torch.distributed.new_group`). The mesh is passed
explicitly to whatever needs it; nothing here is global.

With a world of one process no process group is created and every group is None: callers treat a size-1 axis as
"no communication".
"""
from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

AXES = ("pp", "dp", "cp", "tp")  # slowest -> fastest


class MeshError(ValueError):
    """A layout that cannot work: raised before any work, printed as one line."""


@dataclass
class Mesh:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    sizes: dict                           # axis -> degree
    coords: dict                          # axis -> this rank's index on the axis
    groups: dict = field(default_factory=dict)  # axis (or "dp_cp") -> ProcessGroup or None
    ranks: dict = field(default_factory=dict)   # axis (or "dp_cp") -> global ranks of this rank's group
    timeout: datetime.timedelta = datetime.timedelta(seconds=600)  # of every collective (parallel.timeout_s)

    # convenient names: mesh.dp, mesh.dp_rank, mesh.dp_group, ...
    def __getattr__(self, name):
        for suffix, table in (("_rank", "coords"), ("_group", "groups"), ("_ranks", "ranks")):
            if name.endswith(suffix) and name[: -len(suffix)] in self.__dict__.get(table, {}):
                return self.__dict__[table][name[: -len(suffix)]]
        if name in self.__dict__.get("sizes", {}):
            return self.__dict__["sizes"][name]
        raise AttributeError(name)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rank_of(self, **coords) -> int:
        """Global rank at the given axis coordinates (missing axes: this rank's own)."""
        c = {**self.coords, **coords}
        r = 0
        for ax in AXES:
            r = r * self.sizes[ax] + c[ax]
        return r

    def neighbours(self, axis: str) -> tuple[int, int]:
        """(previous, next) global ranks along `axis`, wrapping around (ring order)."""
        n, i = self.sizes[axis], self.coords[axis]
        return self.rank_of(**{axis: (i - 1) % n}), self.rank_of(**{axis: (i + 1) % n})

    def __str__(self):
        return " ".join(f"{ax}{self.coords[ax]}/{self.sizes[ax]}" for ax in ("dp", "pp", "cp", "tp"))

    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def build(dp: int = -1, pp: int = 1, cp: int = 1, tp: int = 1, device: str = "auto",
              timeout_s: int = 600, ep: int = 1) -> "Mesh":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        sizes = check_degrees(world, dp=dp, pp=pp, cp=cp, tp=tp)
        if ep < 1 or (sizes["dp"] * sizes["cp"]) % ep:
            raise MeshError(f"parallel.ep={ep} must divide dp*cp = {sizes['dp']}*{sizes['cp']} (expert parallel is "
                            f"carved out of the data-parallel ranks)")

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if not torch.cuda.is_available():
                raise MeshError("--device=cuda but no CUDA GPU is visible")
            if local_rank >= torch.cuda.device_count():
                raise MeshError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible")
            dev = torch.device("cuda", local_rank)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")

        mesh = Mesh(rank, world, local_rank, dev, sizes, grid_coords(rank, sizes),
                    timeout=datetime.timedelta(seconds=timeout_s))
        if ep > 1:  # not a grid axis: ep groups are runs of the dp x cp group (_make_groups)
            mesh.sizes["ep"], mesh.sizes["edp"] = ep, sizes["dp"] * sizes["cp"] // ep
            i = mesh.coords["dp"] * sizes["cp"] + mesh.coords["cp"]  # index in the dp x cp group
            mesh.coords["ep"], mesh.coords["edp"] = i % ep, i // ep
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=dev if dev.type == "cuda" else None)
        mesh._make_groups()
        return mesh

    def new_group(self, ranks=None, **kwargs):
        """dist.new_group with the run's collective timeout: new_group's own default is 30 minutes, whatever
        init_process_group was given, so a rank mismatch in a subgroup would wait half an hour. Collective: every
        rank of the world calls it, in the same order."""
        return dist.new_group(ranks, timeout=self.timeout, **kwargs)

    def _make_groups(self):
        """One group per line of the grid along each axis, created in the same order on every rank."""
        grid = [range(self.sizes[ax]) for ax in AXES]
        lines = {ax: [] for ax in AXES}
        for ax_i, ax in enumerate(AXES):
            others = [a for a in AXES if a != ax]
            for fixed in itertools.product(*[range(self.sizes[a]) for a in others]):
                c = dict(zip(others, fixed))
                lines[ax].append([self.rank_of(**c, **{ax: i}) for i in grid[ax_i]])
        # dp x cp: replicas of the same (pp, tp) shard
        lines["dp_cp"] = [[self.rank_of(pp=p, tp=t, dp=d, cp=c) for d in range(self.dp) for c in range(self.cp)]
                          for p in range(self.pp) for t in range(self.tp)]
        # expert parallel: ep groups are runs of ep consecutive dp x cp ranks (each holds E/ep experts); edp groups
        # are the ranks holding the same experts, one per ep group (their expert gradients reduce there)
        ep = self.sizes.get("ep", 1)
        if ep > 1:
            lines["ep"] = [g[i:i + ep] for g in lines["dp_cp"] for i in range(0, len(g), ep)]
            lines["edp"] = [g[j::ep] for g in lines["dp_cp"] for j in range(ep)]
        for name, all_lines in lines.items():
            for members in all_lines:
                group = None
                if self.world > 1 and len(members) > 1:
                    group = self.new_group(members)  # collective call: every rank makes every group
                if self.rank in members:
                    self.groups[name], self.ranks[name] = group, members

    def destroy(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def grid_coords(rank: int, sizes: dict) -> dict:
    """Grid coordinates of a global rank: rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i."""
    c = {}
    for ax in reversed(AXES):
        c[ax] = rank % sizes[ax]
        rank //= sizes[ax]
    return c


def check_degrees(world: int, dp: int = -1, pp: int = 1, cp: int = 1, tp: int = 1) -> dict:
    """Resolve dp = -1 and check dp*pp*cp*tp == world; one readable line on failure."""
    for name, v in (("pp", pp), ("cp", cp), ("tp", tp)):
        if v < 1:
            raise MeshError(f"parallel.{name}={v} must be >= 1")
    rest = pp * cp * tp
    if dp == -1:
        if world % rest:
            raise MeshError(f"world size {world} is not divisible by pp*cp*tp = {pp}*{cp}*{tp} = {rest}")
        dp = world // rest
    if dp < 1 or dp * rest != world:
        raise MeshError(f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * rest} does not match the world size {world} "
                        f"(set --parallel.dp=-1 to infer dp)")
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
