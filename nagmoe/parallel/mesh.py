"""The (dp x ep) device mesh, its process groups and the few collectives the trainer needs.

Layout: world = dp · ep ranks, `rank = dp_rank · ep + ep_rank` (ep innermost, so an EP group is made of
neighbouring ranks — one node when ep <= GPUs per node). Every rank is a data rank (the loader is split into
world-size shards); EP rank p holds experts [p·E/ep, (p+1)·E/ep); the dp group of a rank is the set of ranks
holding the same experts (one per EP group).

Groups:
  ep_group    the ranks of this EP group (all-to-all of tokens; expert part of the gradient norm)
  dp_group    the ranks replicating this rank's experts (expert gradient all-reduce)
  ddp_group   all ranks, a group of its own for DDP's gradient buckets, so DDP's asynchronous all-reduces
              never share a communicator with the all-to-alls issued inside the same backward pass
One process: no group at all, and every helper below is the identity (no torch.distributed call).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from nagmoe.config import Config, ConfigError
from nagmoe.base.errors import UserError

ZERO_STAGES = (0, 1, 2, 3)
DEEPSPEED_ZERO_STAGES = (1, 2)


def validate_engine(cfg: Config) -> None:
    """`parallel.engine` and what it supports (README, engines table): raises ConfigError (exit 2).
    torch: DDP + EP, Muon, MoD (parallel.zero_stage is not used). deepspeed: ZeRO 1/2 + our EP, AdamW only,
    no MoD yet (nagmoe.train.deepspeed_engine)."""
    p, m = cfg.parallel, cfg.model
    if p.zero_stage not in ZERO_STAGES:
        raise ConfigError(f"parallel.zero_stage: {p.zero_stage} is not one of {', '.join(map(str, ZERO_STAGES))}")
    if p.engine == "torch":
        return
    if p.engine != "deepspeed":
        raise ConfigError(f"parallel.engine: {p.engine!r} is not one of torch, deepspeed")
    if p.zero_stage not in DEEPSPEED_ZERO_STAGES:
        raise ConfigError(f"parallel.zero_stage: {p.zero_stage} is not supported by parallel.engine=deepspeed "
                          "(use 1 or 2: ZeRO-3 would partition the expert stacks our expert parallelism shards "
                          "itself; stage 0 is plain data parallelism, which parallel.engine=torch does)")
    optimizer = cfg.train.optimizer
    if optimizer != "adamw":
        raise ConfigError(f"train.optimizer: {optimizer!r} is not supported by parallel.engine=deepspeed, which "
                          "runs AdamW for every role (Muon needs whole matrices; ZeRO hands the optimizer flat "
                          "partitions); set train.optimizer=adamw or use parallel.engine=torch")
    if m.mod.skip_rate > 0:
        raise ConfigError(f"model.mod.skip_rate: {m.mod.skip_rate} (Mixture-of-Depths) is not supported by "
                          "parallel.engine=deepspeed yet; use parallel.engine=torch or model.mod.skip_rate=0")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("parallel.engine=deepspeed needs the deepspeed package: "
                          "DS_BUILD_OPS=0 pip install 'deepspeed==0.19.8'")


def validate_parallel(cfg: Config, world_size: int) -> None:
    """`parallel.*` against the launch: raises ConfigError (exit 2) naming the key."""
    p, m = cfg.parallel, cfg.model
    validate_engine(cfg)
    if p.ep < 1:
        raise ConfigError(f"parallel.ep: {p.ep} must be >= 1")
    if world_size % p.ep:
        raise ConfigError(f"parallel.ep: {p.ep} must divide the world size ({world_size} processes)")
    if p.ep > 1:
        if m.ffn != "moe":
            raise ConfigError(f"parallel.ep: {p.ep} needs model.ffn=moe (a dense model has no experts)")
        if m.moe.n_experts % p.ep:
            raise ConfigError(f"parallel.ep: {p.ep} must divide model.moe.n_experts={m.moe.n_experts}")


@dataclass
class ParallelMesh:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ep: int = 1
    device_mesh: Any = None  # torch DeviceMesh ("dp", "ep"), None for one process
    ep_group: Any = None
    dp_group: Any = None
    ddp_group: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp(self) -> int:
        return self.world_size // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: Config, rank: int = 0, world_size: int = 1, local_rank: int = 0,
              device_type: str = "cpu") -> "ParallelMesh":
        """Validate `parallel.*` for this world size and create the mesh (collective when distributed)."""
        validate_parallel(cfg, world_size)
        if world_size == 1:
            return cls()
        if not (dist.is_available() and dist.is_initialized()):
            raise UserError(f"world size {world_size} needs an initialised process group (launch with torchrun "
                            "or srun; nagmoe.parallel.env.init_distributed)")
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise UserError(f"rank {rank}/{world_size} disagrees with the process group "
                            f"({dist.get_rank()}/{dist.get_world_size()})")
        from torch.distributed.device_mesh import DeviceMesh

        from nagmoe.parallel.env import group_timeout

        # Every group gets the default group's timeout (NAGMOE_DIST_TIMEOUT_S): torch gives a new group its
        # backend's default (30 min) instead, so a rank hung in an EP collective would hold the others that long.
        timeout = group_timeout()
        ep = cfg.parallel.ep
        dp = world_size // ep
        layout = torch.arange(world_size).view(dp, ep)  # rank = dp_rank * ep + ep_rank
        ep_group, _ = dist.new_subgroups_by_enumeration(layout.tolist(), timeout=timeout)
        dp_group, _ = dist.new_subgroups_by_enumeration(layout.t().tolist(), timeout=timeout)
        ddp_group = dist.new_group(list(range(world_size)), timeout=timeout)
        mesh = DeviceMesh.from_group([dp_group, ep_group], device_type, mesh=layout, mesh_dim_names=("dp", "ep"))
        return cls(rank, world_size, local_rank, ep, mesh, ep_group, dp_group, ddp_group)

    @classmethod
    def from_process_group(cls, cfg: Config, device_type: str = "cpu") -> "ParallelMesh":
        """The mesh of the initialised default process group (one process when there is none)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls.build(cfg, device_type=device_type)
        from nagmoe.parallel.env import read_dist_env

        local_rank = read_dist_env().local_rank
        return cls.build(cfg, dist.get_rank(), dist.get_world_size(), local_rank, device_type)

    # ------------------------------------------------------------------------------------------------------
    # Collectives over all ranks (identity for one process)
    # ------------------------------------------------------------------------------------------------------
    def all_reduce(self, values: Sequence[float], op=None, dtype=torch.float64) -> list[float]:
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=dtype, device=self.collective_device())
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.tolist()

    def mean(self, values: Sequence[float]) -> list[float]:
        """Element-wise mean over ranks (float64)."""
        if not self.distributed:
            return [float(v) for v in values]
        return [v / self.world_size for v in self.all_reduce(values)]

    def mean_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise mean over ranks of a tensor, on its own device (no host read)."""
        if not self.distributed:
            return t
        buf = t.to(self.collective_device(), torch.float64)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return (buf / self.world_size).to(t.device, t.dtype)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (all-reduce MAX)."""
        if not self.distributed:
            return bool(flag)
        return self.all_reduce([1.0 if flag else 0.0], op=dist.ReduceOp.MAX)[0] > 0.5

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's python object on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 only and return its result everywhere; a UserError there is raised on every rank
        (so no rank waits forever in the next collective)."""
        if not self.distributed:
            return fn()
        result, error = None, None
        if self.rank == 0:
            try:
                result = fn()
            except UserError as e:
                error = str(e)
        result, error = self.broadcast((result, error))
        if error is not None:
            raise UserError(error)
        return result

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def collective_device(self) -> torch.device:
        """Where a host value travels in a collective: NCCL reduces CUDA tensors only, gloo CPU ones."""
        if self.distributed and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
