"""Distributed Muon: the Newton-Schulz orthogonalisation split over the ranks that replicate each matrix.

Without this every data-parallel replica repeats the same Newton-Schulz work for every matrix it holds. Here
the ranks that hold identical copies of a parameter (and, after gradient synchronisation, identical gradients
and momentum) share that work:

  who holds what  `Replication` (from the trainer, `muon_replication(mesh, expert_names)`, never from globals):
                  replicated parameters -> the whole world (the default process group); expert shards under
                  EP -> the mesh's dp group (the ranks holding the same experts). A group of one rank (one
                  process, or dp = 1 for the experts) runs today's per-parameter loop, bit for bit.
  assignment      per group, the matrices (last two dims; an expert stack (E, a, b) is E matrices) are
                  bucketed by (shape, dtype, ns_steps) and every bucket is cut into contiguous runs, one per
                  member: each member gets floor(N/G), the N mod G left over go to the members with the least
                  Newton-Schulz cost so far (cost ~ m²(2n+m) for an m x n matrix, m <= n; buckets in order of
                  decreasing cost, ties by rank). Deterministic: every member computes the same plan from the
                  parameter order and shapes alone (checked by a fingerprint all-gather when the plan is built).
  step            momentum is updated for every matrix on every rank (state stays replicated: checkpoints and
                  single-process resumes are unchanged); each rank forms the Nesterov update and runs
                  `orthogonalise` on its own runs only, batched per bucket (at most BATCH_ELEMENTS per call);
                  one all_gather per (group, wire dtype) brings every member's results to every member
                  (issued asynchronously, so the world group's exchange overlaps the experts' compute); every
                  rank then applies the identical updates W <- W (1 - lr wd) - lr sqrt(max(1, r/c)) O.
  wire dtype      the results travel in the Newton-Schulz dtype when it is narrower than the gradient's (bf16
                  on CUDA: exact, the kernel's output is a bf16 value cast up), else in the gradient's dtype.

Agreement: every member must see the same Muon parameters with a gradient (DDP and `sync_expert_grads` give
every replicated and every expert parameter a gradient on every rank each step).

Tolerances (tests/parallel/test_distributed_muon.py): fp32 (CPU) results equal single-rank Muon within
FP32_RTOL relative — the per-matrix kernel is the same, only the batch it runs in differs. bf16 Newton-Schulz
(CUDA, `ns_dtype=None`): a matrix orthogonalised in another batch may take other cuBLAS kernels, so the GPU
twin is held to BF16_RTOL (relative Frobenius error of each update), inside the 0.05 already allowed between
bf16 and fp32 Newton-Schulz (tests/train/test_optim.py). In both cases every rank applies bitwise the same
update (all take the owner's result).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from nagmoe.ops import newton_schulz as _optim  # the same kernel as nagmoe.train.optim.Muon

FP32_RTOL = 1e-5
BF16_RTOL = 2e-2
BATCH_ELEMENTS = 1 << 26  # elements per orthogonalise call (64 Mi: 64 matrices of 512 x 2048), bounds memory


# ----------------------------------------------------------------------------------------------------------
# Who holds what
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaGroup:
    """Ranks holding identical copies of a parameter. `ranks` are global ranks in the group's rank order;
    `group` the process group over them (None: the default group, which must then be the whole world)."""
    ranks: tuple[int, ...]
    group: Any = None
    name: str = "world"

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index_of(self, rank: int) -> int:
        return self.ranks.index(rank)

    def __repr__(self) -> str:
        return f"ReplicaGroup({self.name}, ranks={list(self.ranks)})"


@dataclass(frozen=True)
class Replication:
    """This process's global `rank`; parameter name -> the group replicating it (`overrides`, e.g. the expert
    stacks' dp group), `default` (all ranks) for every other parameter."""
    rank: int
    default: ReplicaGroup
    overrides: Mapping[str, ReplicaGroup] = field(default_factory=dict)

    def group_of(self, name: str) -> ReplicaGroup:
        return self.overrides.get(name, self.default)

    def describe(self) -> str:
        groups = {g.ranks: g for g in (self.default, *self.overrides.values())}
        return ", ".join(repr(g) for g in groups.values())


def muon_replication(mesh, expert_names: Sequence[str] = ()) -> Optional[Replication]:
    """The replication of a `ParallelMesh` for distributed Muon: None for one process (today's Muon);
    replicated parameters over all ranks (default group), the sharded expert stacks over the mesh's dp group."""
    if not mesh.distributed:
        return None
    world = ReplicaGroup(tuple(range(mesh.world_size)), None, "world")
    overrides = {}
    if expert_names:
        ranks = tuple(k * mesh.ep + mesh.ep_rank for k in range(mesh.dp))  # rank = dp_rank * ep + ep_rank
        if mesh.dp_group is not None and hasattr(dist, "get_process_group_ranks"):
            actual = tuple(dist.get_process_group_ranks(mesh.dp_group))
            if actual != ranks:
                raise RuntimeError(f"the mesh's dp group has ranks {actual}, the layout says {ranks}")
        dp = ReplicaGroup(ranks, mesh.dp_group, "dp")
        overrides = {name: dp for name in expert_names}
    return Replication(mesh.rank, world, overrides)


# ----------------------------------------------------------------------------------------------------------
# The plan (pure: shapes in, assignment out; every member of a group computes the same one)
# ----------------------------------------------------------------------------------------------------------
def matrix_cost(rows: int, cols: int) -> int:
    """Newton-Schulz cost of one matrix up to a constant: on the wide orientation (m x n, m <= n) each step
    forms X X^T (m²n), its square (m³) and the product with X (m²n)."""
    m, n = min(rows, cols), max(rows, cols)
    return m * m * (2 * n + m)


@dataclass(frozen=True)
class MatrixSpec:
    """One Muon parameter as the plan sees it: `count` matrices of `rows x cols` (leading dims flattened)."""
    group: ReplicaGroup
    count: int
    rows: int
    cols: int
    dtype: torch.dtype
    ns_steps: int
    wire_dtype: torch.dtype


@dataclass(frozen=True)
class Segment:
    """Matrices [lo, hi) of work item `item`."""
    item: int
    lo: int
    hi: int


@dataclass
class Bucket:
    rows: int
    cols: int
    ns_steps: int
    counts: list[int]  # matrices per member
    segments: list[list[Segment]]  # per member, in order

    @property
    def matrix_elements(self) -> int:
        return self.rows * self.cols


@dataclass
class Exchange:
    """One all_gather: the buckets of one replica group travelling in one wire dtype."""
    group: ReplicaGroup
    wire_dtype: torch.dtype
    buckets: list[Bucket]

    def elements(self, member: int) -> int:
        return sum(b.counts[member] * b.matrix_elements for b in self.buckets)

    @property
    def length(self) -> int:
        """Per-member length of the gathered buffer (the largest member's share; others are padded)."""
        return max(self.elements(m) for m in range(self.group.size))

    def fingerprint(self) -> str:
        text = repr((self.group.ranks, str(self.wire_dtype),
                     [(b.rows, b.cols, b.ns_steps, b.counts) for b in self.buckets]))
        return hashlib.sha256(text.encode()).hexdigest()


def plan_exchanges(specs: Sequence[MatrixSpec]) -> list[Exchange]:
    """Assign the matrices of `specs` (items, in parameter order) to the members of their replica groups.

    Groups in order of decreasing size (the world before the dp groups), then by ranks; one running cost per
    global rank, so a rank's share of a dp group's leftovers accounts for its share of the world's. Within a
    group, buckets of equal (shape, dtype, ns_steps, wire dtype) in order of decreasing matrix cost (then of
    first appearance); each member takes floor(N/G) matrices, the N mod G left over go to the members with the
    lowest running cost (ties: lower member index); member m's run is the m-th contiguous run of the bucket's
    matrices (items in order, each item's matrices in order)."""
    by_group: dict[tuple, list[int]] = {}
    groups: dict[tuple, ReplicaGroup] = {}
    for i, s in enumerate(specs):
        if s.group.size > 1:
            by_group.setdefault(s.group.ranks, []).append(i)
            groups[s.group.ranks] = s.group
    load: dict[int, int] = {}
    exchanges = []
    for ranks in sorted(by_group, key=lambda r: (-len(r), r)):
        group, G = groups[ranks], len(ranks)
        buckets: dict[tuple, list[int]] = {}
        for i in by_group[ranks]:
            s = specs[i]
            buckets.setdefault((s.rows, s.cols, s.dtype, s.ns_steps, s.wire_dtype), []).append(i)
        order = sorted(enumerate(buckets.items()), key=lambda kv: (-matrix_cost(*kv[1][0][:2]), kv[0]))
        by_wire: dict[torch.dtype, list[Bucket]] = {}
        for _, ((rows, cols, _dtype, ns_steps, wire), items) in order:
            cost = matrix_cost(rows, cols)
            total = sum(specs[i].count for i in items)
            base, left = divmod(total, G)
            extra = set(sorted(range(G), key=lambda m: (load.get(ranks[m], 0), m))[:left])
            counts = [base + (m in extra) for m in range(G)]
            for m in range(G):
                load[ranks[m]] = load.get(ranks[m], 0) + counts[m] * cost
            segments: list[list[Segment]] = []
            pos = [0, 0]  # (index into items, matrix within that item)
            for m in range(G):
                need, mine = counts[m], []
                while need:
                    k, lo = pos
                    take = min(need, specs[items[k]].count - lo)
                    mine.append(Segment(items[k], lo, lo + take))
                    need -= take
                    pos = [k + 1, 0] if lo + take == specs[items[k]].count else [k, lo + take]
                segments.append(mine)
            by_wire.setdefault(wire, []).append(Bucket(rows, cols, ns_steps, counts, segments))
        for wire in sorted(by_wire, key=str):
            exchanges.append(Exchange(group, wire, by_wire[wire]))
    return exchanges


# ----------------------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------------------
@dataclass
class MuonWork:
    """One Muon parameter of this step: its (already updated) momentum buffer and its group's settings."""
    param: torch.Tensor
    name: str
    grad: torch.Tensor
    buf: torch.Tensor
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    ns_steps: int


def wire_dtype_for(grad_dtype: torch.dtype, ns_dtype: torch.dtype) -> torch.dtype:
    """The narrower of the two (exact: the kernel's result is an `ns_dtype` value cast to `grad_dtype`)."""
    return ns_dtype if ns_dtype.itemsize < grad_dtype.itemsize else grad_dtype


class ShardedOrthogonaliser:
    """Muon's orthogonalise-and-apply for one `Replication` (module docstring). `last_matrices`: how many
    matrices this rank orthogonalised in the last step (`last_total`: how many it applied)."""

    def __init__(self, replication: Replication, ns_dtype: Optional[torch.dtype] = None):
        self.replication, self.ns_dtype = replication, ns_dtype
        self._plan_key: Optional[tuple] = None
        self._plan: list[Exchange] = []
        self.last_matrices = 0
        self.last_total = 0

    # ------------------------------------------------------------------------------------------------------
    def _specs(self, work: Sequence[MuonWork]) -> list[MatrixSpec]:
        specs = []
        for w in work:
            ns = self.ns_dtype or (torch.bfloat16 if w.grad.is_cuda else torch.float32)
            rows, cols = w.param.shape[-2:]
            specs.append(MatrixSpec(self.replication.group_of(w.name), w.param.numel() // (rows * cols),
                                    rows, cols, w.grad.dtype, w.ns_steps, wire_dtype_for(w.grad.dtype, ns)))
        return specs

    def plan(self, work: Sequence[MuonWork]) -> list[Exchange]:
        """The cached plan for this set of parameters; a new one is checked against the other members'."""
        specs = self._specs(work)
        key = tuple((w.name, tuple(w.param.shape), s) for w, s in zip(work, specs))
        if key != self._plan_key:
            for w, s in zip(work, specs):
                if s.group.size > 1 and not w.param.is_contiguous():
                    raise ValueError(f"distributed Muon needs contiguous parameters; {w.name} is not")
                if s.group.size > 1 and self.replication.rank not in s.group.ranks:
                    raise ValueError(f"rank {self.replication.rank} is not in {s.group} of {w.name}")
            plan = plan_exchanges(specs)
            for ex in plan:
                self._check_agreement(ex, work[0].param.device)
            self._plan_key, self._plan = key, plan
        return self._plan

    def _check_agreement(self, ex: Exchange, device: torch.device) -> None:
        """All members built the same plan for this exchange (else the gathered buffers would be misread)."""
        mine = torch.tensor([int(ex.fingerprint()[:15], 16)], dtype=torch.int64, device=device)
        theirs = [torch.empty_like(mine) for _ in range(ex.group.size)]
        dist.all_gather(theirs, mine, group=ex.group.group)
        if any(int(t) != int(mine) for t in theirs):
            raise RuntimeError(f"distributed Muon: the members of {ex.group} disagree on the matrices to "
                               "orthogonalise (another set of Muon parameters with a gradient, or another order)")

    # ------------------------------------------------------------------------------------------------------
    def step(self, work: Sequence[MuonWork]) -> None:
        """Orthogonalise (this rank's share), exchange and apply every update of `work`; momentum buffers
        must already hold this step's value."""
        me = self.replication.rank
        local = [w for w in work if self.replication.group_of(w.name).size == 1]
        shared = [w for w in work if self.replication.group_of(w.name).size > 1]
        matrices = 0
        for w in local:  # exactly Muon.step's single-process arithmetic
            update = w.grad.lerp(w.buf, w.momentum) if w.nesterov else w.buf
            ortho = _optim.orthogonalise(update, w.ns_steps, self.ns_dtype)
            if w.weight_decay:
                w.param.mul_(1.0 - w.lr * w.weight_decay)
            w.param.add_(ortho, alpha=-w.lr * _optim.muon_shape_scale(w.param.shape))
            matrices += w.param.numel() // (w.param.shape[-2] * w.param.shape[-1])
        self.last_total = matrices
        if not shared:
            self.last_matrices = matrices
            return
        plan = self.plan(shared)
        pending = []
        for ex in plan:  # compute this rank's share, start its exchange, go on with the next group
            member = ex.group.index_of(me)
            length = ex.length
            device = shared[0].param.device
            send = torch.zeros(length, dtype=ex.wire_dtype, device=device)
            offset = 0
            for bucket in ex.buckets:
                n = self._orthogonalise_share(shared, bucket, bucket.segments[member], send, offset)
                offset += n * bucket.matrix_elements
                matrices += n
            gathered = torch.empty(ex.group.size, length, dtype=ex.wire_dtype, device=device)
            handle = dist.all_gather(list(gathered.unbind(0)), send, group=ex.group.group, async_op=True)
            pending.append((ex, gathered, handle))
        for w in shared:  # weight decay while the results travel (same order as Muon.step: decay, then add)
            if w.weight_decay:
                w.param.mul_(1.0 - w.lr * w.weight_decay)
        for ex, gathered, handle in pending:
            handle.wait()
            for m in range(ex.group.size):
                offset = 0
                for bucket in ex.buckets:
                    r, c = bucket.rows, bucket.cols
                    for seg in bucket.segments[m]:
                        w = shared[seg.item]
                        k = seg.hi - seg.lo
                        ortho = gathered[m, offset:offset + k * r * c].view(k, r, c)
                        w.param.view(-1, r, c)[seg.lo:seg.hi].add_(
                            ortho, alpha=-w.lr * _optim.muon_shape_scale(w.param.shape))
                        offset += k * r * c
                        self.last_total += k
        self.last_matrices = matrices

    def _orthogonalise_share(self, work: Sequence[MuonWork], bucket: Bucket, segments: Sequence[Segment],
                             send: torch.Tensor, offset: int) -> int:
        """Orthogonalise this member's runs of `bucket` in batches, writing the results at `offset` of `send`;
        returns the number of matrices."""
        r, c = bucket.rows, bucket.cols
        per_call = max(1, BATCH_ELEMENTS // (r * c))
        pieces: list[tuple[MuonWork, int, int]] = []
        for seg in segments:  # split the runs into calls of at most `per_call` matrices
            lo = seg.lo
            while lo < seg.hi:
                pieces.append((work[seg.item], lo, min(seg.hi, lo + per_call)))
                lo = pieces[-1][2]
        done = 0
        while pieces:
            batch, n = [], 0
            while pieces and n + (pieces[0][2] - pieces[0][1]) <= per_call:
                w, lo, hi = pieces.pop(0)
                grad, buf = w.grad.reshape(-1, r, c)[lo:hi], w.buf.reshape(-1, r, c)[lo:hi]
                batch.append(grad.lerp(buf, w.momentum) if w.nesterov else buf)  # Muon.step's update
                n += hi - lo
            x = batch[0] if len(batch) == 1 else torch.cat(batch)
            ortho = _optim.orthogonalise(x, bucket.ns_steps, self.ns_dtype)
            start = offset + done * r * c
            send[start:start + n * r * c].view(n, r, c).copy_(ortho)
            done += n
        return done
