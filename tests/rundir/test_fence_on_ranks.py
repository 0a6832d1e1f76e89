"""Issue 41, the fence on several ranks: rank 0 holds the run dir's lease; once another trainer takes it over,
a checkpoint save with the trainer's fence stops on EVERY rank with the same one-line UserError naming the new
holder, and nothing is published (2 real gloo ranks, no training)."""
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gloo_ranks import run_on_ranks  # noqa: E402


def save_after_takeover(run_dir: str) -> dict:
    """On each rank: hold the lease on rank 0, save step 1 (fenced, publishes), let a stranger take the lease over,
    try to save step 2 with the same fence; return what each save did."""
    import torch
    import torch.distributed as dist

    from nagmoe.rundir.lease import RunDirLease, fence_on_all_ranks
    from nagmoe.checkpoint.torch_layout import save_checkpoint
    from nagmoe.base.errors import UserError
    from nagmoe.parallel.mesh import ParallelMesh

    rank = dist.get_rank()
    mesh = ParallelMesh(rank=rank, world_size=dist.get_world_size())
    lease = RunDirLease(run_dir).acquire() if rank == 0 else None
    model = torch.nn.Linear(4, 4)
    out = {}
    try:
        save_checkpoint(run_dir, 1, model, fence=lambda: fence_on_all_ranks(mesh, lease))
        out["first"] = "saved"
        if rank == 0:
            RunDirLease(run_dir, take_over=True).acquire()._stop.set()  # another trainer, here a stranger's lease
        dist.barrier()
        try:
            save_checkpoint(run_dir, 2, model, fence=lambda: fence_on_all_ranks(mesh, lease))
            out["second"] = "saved"
        except UserError as e:
            out["second"] = str(e)
        dist.barrier()  # every rank is still in step: the verdict was shared, no one waits in a collective
    finally:
        if lease is not None:
            lease.release()
    return out


def test_a_lost_lease_stops_every_rank_before_the_publish(tmp_path):
    run_dir = str(tmp_path / "run")
    results = run_on_ranks(save_after_takeover, 2, run_dir, timeout=120)
    assert [r["first"] for r in results] == ["saved", "saved"]
    messages = [r["second"] for r in results]
    assert messages[0] == messages[1] and "taken over by" in messages[0] and "\n" not in messages[0], messages
    assert sorted(n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if ".tmp-" not in n) == ["step_000001"]
