import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from nagmoe.config import TrainConfig
from nagmoe.base.errors import UserError
from nagmoe.checkpoint import (
    MANIFEST,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from nagmoe.train.optim import build_optimizers

from role_toy import ToyModel, toy_batch


def _train_steps(model, bundle, n, seed=0):
    for i in range(n):
        idx, targets = toy_batch(seed + i)
        bundle.zero_grad()
        model(idx, targets).backward()
        bundle.step()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fresh(seed):
    torch.manual_seed(seed)
    model = ToyModel()
    return model, build_optimizers(model, TrainConfig())


def _tensor_file(path):
    return next(os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".distcp"))


@pytest.fixture
def saved(tmp_path):
    """A run dir with one checkpoint at step 3 of a toy run."""
    model, bundle = _fresh(0)
    _train_steps(model, bundle, 3)
    bundle.set_lr_multiplier(0.37)  # group hyper-parameters must come back too
    extra = {"tokens": 96, "flops": 1.5e6, "loader": {"shard": 2, "offset": 17}}
    path = save_checkpoint(str(tmp_path), 3, model, bundle, extra, keep=2)
    return tmp_path, path, model, bundle, extra


def test_round_trip_restores_everything_and_next_step_is_bitwise_identical(saved):
    run_dir, path, model, bundle, extra = saved
    assert path == os.path.join(str(run_dir), "checkpoints", "step_000003")
    assert sorted(os.listdir(path))[-2:] == ["manifest.json", "state.json"]
    saved_params = _params(model)
    rng_after_save = (torch.rand(4), np.random.rand(2), random.random())
    _train_steps(model, bundle, 1, seed=100)  # the reference next step
    reference = _params(model)

    other, other_bundle = _fresh(1)  # different init, untouched optimizer state
    torch.manual_seed(999)
    np.random.seed(999)
    random.seed(999)
    restored = load_checkpoint(path, other, other_bundle)
    assert restored == {**extra, "step": 3}
    for n, p in other.named_parameters():
        assert torch.equal(p, saved_params[n]), n
    rng_after_load = (torch.rand(4), np.random.rand(2), random.random())
    assert torch.equal(rng_after_load[0], rng_after_save[0])
    assert np.array_equal(rng_after_load[1], rng_after_save[1]) and rng_after_load[2] == rng_after_save[2]
    for group, other_group in zip(bundle.param_groups, other_bundle.param_groups):
        assert other_group["lr"] == group["lr"] == 0.37 * group["initial_lr"]
    _train_steps(other, other_bundle, 1, seed=100)
    for n, p in other.named_parameters():
        assert torch.equal(p, reference[n]), n


def test_generic_plain_module_and_single_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(5, 4)

    def step(m, o):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()

    step(model, opt)
    path = save_checkpoint(str(tmp_path), 1, model, opt, {"note": "plain"}, keep=1)
    at_save = [p.detach().clone() for p in model.parameters()]
    step(model, opt)
    reference = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(5)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    assert load_checkpoint(path, other, other_opt)["note"] == "plain"
    step(other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), reference))
    # Model-only load (e.g. for evaluation) from a checkpoint that also holds optimizer state.
    third = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    load_checkpoint(path, third, restore_rng=False)
    assert all(torch.equal(a, b) for a, b in zip(third.parameters(), at_save))


def test_half_written_checkpoints_are_never_latest(saved):
    run_dir, path, _, _, _ = saved
    root = os.path.dirname(path)
    # A complete-looking copy still under its tmp name (crash before the rename).
    shutil.copytree(path, os.path.join(root, "step_000009.tmp-4242"))
    # Crash before the manifest was written.
    no_manifest = os.path.join(root, "step_000006")
    shutil.copytree(path, no_manifest)
    os.remove(os.path.join(no_manifest, MANIFEST))
    # A truncated tensor file.
    truncated = os.path.join(root, "step_000007")
    shutil.copytree(path, truncated)
    tensor_file = _tensor_file(truncated)
    with open(tensor_file, "r+b") as f:
        f.truncate(os.path.getsize(tensor_file) // 2)
    assert [s for s, _ in list_checkpoints(str(run_dir))] == [3, 6, 7]
    assert latest_valid_checkpoint(str(run_dir)) == path
    assert latest_valid_checkpoint(str(run_dir / "nothing_here")) is None


def test_corrupted_file_raises_user_error_naming_it_before_loading(saved):
    run_dir, path, _, _, _ = saved
    tensor_file = _tensor_file(path)
    with open(tensor_file, "r+b") as f:  # flip one byte, same size
        f.seek(os.path.getsize(tensor_file) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    other, other_bundle = _fresh(1)
    before = _params(other)
    with pytest.raises(UserError, match=os.path.basename(tensor_file)) as err:
        load_checkpoint(path, other, other_bundle)
    assert "sha256" in str(err.value) and "\n" not in str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    assert latest_valid_checkpoint(str(run_dir)) is None
    os.remove(os.path.join(path, MANIFEST))
    with pytest.raises(UserError, match="no manifest.json"):
        load_checkpoint(path, other, other_bundle)


def test_keep_last_k_and_no_leftovers(tmp_path):
    model, bundle = _fresh(0)
    for step in (2, 4, 6):
        _train_steps(model, bundle, 1, seed=step)
        save_checkpoint(str(tmp_path), step, model, bundle, {"tokens": step}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["step_000004", "step_000006"]
    assert latest_valid_checkpoint(str(tmp_path)).endswith("step_000006")
    # Saving a step that is on disk and valid again writes nothing (issue 21: no window without a copy).
    save_checkpoint(str(tmp_path), 4, model, bundle, {"tokens": 44}, keep=2)
    with open(root / "step_000004" / "state.json") as f:
        assert json.load(f)["extra"] == {"tokens": 4}
    assert sorted(os.listdir(root)) == ["step_000004", "step_000006"]
    # Step 6 invalid: a run resumed from step 4 that saves step 5 drops the abandoned step 6.
    with open(root / "step_000006" / "state.json", "a") as f:
        f.write(" ")
    load_checkpoint(str(root / "step_000004"), model, bundle)
    save_checkpoint(str(tmp_path), 5, model, bundle, {"tokens": 55}, keep=2)
    assert sorted(os.listdir(root)) == ["step_000004", "step_000005"]
    with pytest.raises(UserError, match="keep_checkpoints"):
        save_checkpoint(str(tmp_path), 7, model, bundle, {}, keep=0)


def test_extra_state_must_be_json(tmp_path):
    model, bundle = _fresh(0)
    with pytest.raises(TypeError):
        save_checkpoint(str(tmp_path), 1, model, bundle, {"bad": object()})
    assert not os.path.exists(tmp_path / "checkpoints")


def _distributed_worker(rank, world, tmp):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        model, bundle = _fresh(0)  # replicated state, as under DDP
        _train_steps(model, bundle, 2)
        torch.manual_seed(100 + rank)  # every rank has its own RNG stream
        path = save_checkpoint(tmp, 2, model, bundle, {"tokens": 64}, keep=1)
        after_save = torch.rand(3)
        _train_steps(model, bundle, 1, seed=50)
        other, other_bundle = _fresh(7)
        assert load_checkpoint(path, other, other_bundle) == {"tokens": 64, "step": 2}
        assert torch.equal(torch.rand(3), after_save)  # this rank's RNG, not rank 0's
        _train_steps(other, other_bundle, 1, seed=50)
        assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
        if rank == 0:
            assert latest_valid_checkpoint(tmp) == path
            with open(os.path.join(path, "state.json")) as f:
                assert len(json.load(f)["rng"]) == world
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_distributed_save_load_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_distributed_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000002"]
