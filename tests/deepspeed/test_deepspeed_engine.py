"""parallel.engine=deepspeed on 2 real gloo ranks (fresh processes, OMP_NUM_THREADS=1) against the torch engine.

One 2-rank session (module fixture) runs every scenario; the tests check its results:
  * each rank's experts (and everything else) survive `deepspeed.initialize` unchanged, while the same expert
    stacks handed to DeepSpeed as ordinary parameters get rank 0's broadcast over rank 1's (the check can fail);
  * with the same optimizer (AdamW for every role), 3 steps of EP=2 with 2 accumulation micro-steps give the
    torch engine's losses, gradient norms, full gradients before clipping and final parameters (fp32, 1e-5),
    under ZeRO-1 and ZeRO-2, and so does DP=2 (EP=1, experts inside ZeRO) under ZeRO-2; clipping is active
    (the norms exceed train.grad_clip);
  * with the loss-free expert bias on (issue 43), ZeRO-2 at EP=2: every step's grad_norm equals one process's
    (1e-5), and b after the run is bitwise equal on both ranks and to it; with the global-batch balance loss
    too, ZeRO-2 equals the torch engine at EP=2 as above, b included;
  * 2 steps, a DeepSpeed checkpoint (bias and global balance on) and a weights-only milestone, a resume to 3
    steps: the trajectory of the straight 3-step run, bitwise, b included; the milestone is the checkpoint's
    weights cast by role;
    the run dir keeps its contract (metrics once per step, summary.json, run_info.json, verified checkpoints);
  * the whole model read back from a DeepSpeed checkpoint in one process (no unpickling) gives the logits of
    the trained 2-rank EP model; eval, generate, analyze and consolidate give the same outputs on the ZeRO-1
    run as on its state rewritten as a torch-engine checkpoint.
One process through the CLI: a DeepSpeed run and its resume; unsupported combinations exit 2 with a message.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ds_ranks import requires_deepspeed, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.abspath(__file__)

pytestmark = pytest.mark.distributed

TOL = 1e-5  # losses and every gradient (the acceptance)
# Parameters after 3 AdamW steps: a gradient element that nearly cancels is normalised by its own tiny RMS,
# so 1e-7 summation-order differences between engines can move that one element by ~lr (seen: 1 of 1024
# elements at 3-6e-5); every other element agrees to ~1e-7.
PARAM_TOL = 1e-4
STEPS = 3
# 4 rows of 64 tokens per step: 2 per rank, one per micro-step (2 accumulation micro-steps)
BASE = ("train.micro_batch_tokens=64", f"train.max_steps={STEPS}", "train.eval_tokens=256", "train.schedule_steps=10",
        "train.warmup_steps=2", "parallel.ep=2", "train.optimizer=adamw",
        # AdamW turns summation-order rounding of a nearly cancelled gradient element into a parameter
        # difference proportional to the LR (docs/decisions.md, distributed equality); the gradients are
        # compared at 1e-5 directly, the parameters at 10x smaller LRs than the defaults
        "train.lr_embed=0.02", "train.lr_matrix=0.002")
DS = ("parallel.engine=deepspeed",)
BIAS = ("model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01")
# the global-batch balance loss's running count depends on the layout at accum > 1 (micro-step m covers the rows
# of every rank's first m micro-steps), so it is compared with the torch engine at the same layout
BALANCING = (*BIAS, "model.moe.lb_granularity=global_batch")


def load(overrides):
    from nagmoe.config import load_config

    return load_config(os.path.join(REPO, "configs/tiny.yaml"), list(overrides))


def params_of(model):
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def probe_idx():
    return torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(7))


def bias_of(model):
    from nagmoe.model.router_health import expert_biases

    b = expert_biases(model)
    return None if b is None else b.tolist()


def step_losses(run_dir):
    from nagmoe.rundir.metrics import read_metrics

    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]


# ----------------------------------------------------------------------------------------------------------
# What the 2 ranks run (in fresh processes: ds_ranks imports this file there)
# ----------------------------------------------------------------------------------------------------------
def experts_through_initialize(overrides):
    """Parameters before and after our engine's `deepspeed.initialize`, and rank 1's experts after handing
    the plain model to DeepSpeed (the broadcast we avoid)."""
    import deepspeed
    import torch.distributed as dist

    from nagmoe.model import build_model
    from nagmoe.train.deepspeed_engine import DeepSpeedEngine
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.mesh import ParallelMesh

    cfg = load([*overrides, *DS, "parallel.zero_stage=2"])
    mesh = ParallelMesh.from_process_group(cfg)

    def sharded_model():
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model)
        return model, shard_experts(model, mesh)

    model, names = sharded_model()
    before = params_of(model)
    DeepSpeedEngine(model, names, mesh, cfg, micro_rows=1, accum=2)
    after = params_of(model)

    # control: the same expert stacks as ordinary parameters of the module DeepSpeed gets
    plain = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(torch.tensor(before[n])) for n in names})
    deepspeed.initialize(model=plain, optimizer=torch.optim.AdamW(plain.parameters()),
                         config=DeepSpeedEngine.deepspeed_config(cfg, 1, 2, dist.get_world_size(), 10 ** 6))
    plain_changed = sorted(n for n in names if not np.array_equal(plain[n.replace(".", "_")].detach().numpy(),
                                                                    before[n]))
    return {"names": names, "before": before, "after": after, "plain_changed": plain_changed}


def train_recording(overrides, run_dir):
    """Train with the Trainer; record per step the full gradients before clipping (both engines)."""
    import nagmoe.train.trainer as trainer_module
    trainer = trainer_module.Trainer(load(overrides), run_dir, quiet=True)
    grads = []
    if trainer.engine is not None:
        engine, step = trainer.engine, trainer.engine.step

        def recording_step():
            grads.append({n: g.numpy().copy() for n, g in engine.full_gradients().items()})
            return step()

        engine.step = recording_step
        trainer.run()
    else:
        # the trainer clips with grad_sync.clip_grad_norm_ under EP, torch's otherwise: record before either
        ep_clip, torch_clip = trainer_module.clip_grad_norm_, torch.nn.utils.clip_grad_norm_

        def recording(clip):
            def clip_after_recording(*args, **kwargs):
                grads.append({n: p.grad.numpy().copy() for n, p in trainer.model.named_parameters()})
                return clip(*args, **kwargs)
            return clip_after_recording

        trainer_module.clip_grad_norm_, torch.nn.utils.clip_grad_norm_ = recording(ep_clip), recording(torch_clip)
        try:
            trainer.run()
        finally:
            trainer_module.clip_grad_norm_, torch.nn.utils.clip_grad_norm_ = ep_clip, torch_clip
    trainer.model.eval()
    with torch.no_grad():  # collective under EP: every rank runs it
        logits = trainer.model(probe_idx()).logits.numpy()
    return {"grads": grads, "params": params_of(trainer.model), "expert_names": trainer.expert_names,
            "logits": logits, "bias": bias_of(trainer.model)}


def resume(overrides, run_dir):
    """Train to step 2 (checkpoint), then resume in a new Trainer to step 3."""
    import torch.distributed as dist

    from nagmoe.train.trainer import Trainer

    Trainer(load([*overrides, "train.max_steps=2"]), run_dir, quiet=True).run()
    dist.barrier()
    trainer = Trainer(load(overrides), run_dir, quiet=True)
    start = trainer.progress.step
    trainer.run()
    return {"start": start, "params": params_of(trainer.model), "bias": bias_of(trainer.model)}


def two_rank_session(overrides, tmp):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {"init": experts_through_initialize(overrides)}
    # every run uses train.optimizer=adamw (BASE): the torch engine then runs the DeepSpeed engine's optimizer
    runs = {"torch": [], "zero1": [*DS, "parallel.zero_stage=1"], "zero2": [*DS, "parallel.zero_stage=2"],
            # data parallel only: the experts are replicated, so ZeRO manages them with the rest
            "torch_dp": ["parallel.ep=1"], "zero2_dp": [*DS, "parallel.zero_stage=2", "parallel.ep=1"],
            "zero2_bias": [*DS, "parallel.zero_stage=2", *BIAS],
            "torch_balancing": [*BALANCING], "zero2_balancing": [*DS, "parallel.zero_stage=2", *BALANCING]}
    for name, extra in runs.items():
        run_dir = os.path.join(tmp, name)
        out[name] = train_recording([*overrides, *extra], run_dir)
        out[name]["losses"] = step_losses(run_dir) if rank == 0 else None
    run_dir = os.path.join(tmp, "resumed")  # with a weights-only milestone at step 2 (issue 68, item 4)
    out["resumed"] = resume([*overrides, *DS, "parallel.zero_stage=2", *BALANCING,
                             "train.keep_milestone_every_tokens=512"], run_dir)
    out["resumed"]["losses"] = step_losses(run_dir) if rank == 0 else None
    return out


# ----------------------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def overrides(micro_overrides):
    return [*micro_overrides, *BASE]


@pytest.fixture(scope="module")
def single_bias(overrides, tmp_path_factory):
    """One process, the torch engine, the same global batch (4 micro-steps): the reference of zero2_bias."""
    run_dir = str(tmp_path_factory.mktemp("single_bias"))
    result = train_recording([*overrides, "parallel.ep=1", *BIAS], run_dir)
    return {"losses": step_losses(run_dir), "bias": result["bias"]}


@pytest.fixture(scope="module")
def session(overrides, ds_env, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ds_two_ranks"))
    results = run_ranks(HERE, "two_rank_session", 2, (overrides, tmp), ds_env, os.path.join(tmp, "ranks"),
                        timeout=300)
    return tmp, results


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------
@requires_deepspeed
def test_experts_survive_deepspeed_initialize(session):
    _, results = session
    names = results[0]["init"]["names"]
    assert names == ["blocks.0.ffn.w_in", "blocks.0.ffn.w_out", "blocks.1.ffn.w_in", "blocks.1.ffn.w_out"]
    for r in results:
        init = r["init"]
        assert init["before"].keys() == init["after"].keys()
        for n, v in init["before"].items():
            np.testing.assert_array_equal(init["after"][n], v, err_msg=n)
    # the ranks hold different experts (w_in is randomly initialised; w_out starts at zero on both)
    w_in = [r["init"]["after"]["blocks.0.ffn.w_in"] for r in results]
    assert w_in[0].shape[0] == 2 and not np.array_equal(w_in[0], w_in[1])
    # control: DeepSpeed given the experts as ordinary parameters broadcasts rank 0's over rank 1's
    assert "blocks.0.ffn.w_in" in results[1]["init"]["plain_changed"]
    assert results[0]["init"]["plain_changed"] == []


@requires_deepspeed
@pytest.mark.parametrize("name,reference", [("zero1", "torch"), ("zero2", "torch"), ("zero2_dp", "torch_dp"),
                                            ("zero2_balancing", "torch_balancing")])
def test_deepspeed_engine_equals_torch_engine(session, name, reference):
    _, results = session
    want, got = results[0][reference]["losses"], results[0][name]["losses"]
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([v for _, v, _ in got], [v for _, v, _ in want], rtol=0, atol=TOL)
    np.testing.assert_allclose([g for _, _, g in got], [g for _, _, g in want], rtol=1e-6, atol=0)
    assert max(g for _, _, g in want) > 1.0  # train.grad_clip=1 clips, so the global norm matters
    for rank in (0, 1):
        torch_run, ds_run = results[rank][reference], results[rank][name]
        assert ds_run["bias"] == torch_run["bias"] == results[0][reference]["bias"]  # None without the bias
        assert ds_run["expert_names"] == torch_run["expert_names"]
        assert len(ds_run["grads"]) == len(torch_run["grads"]) == STEPS
        for step, (g_ds, g_torch) in enumerate(zip(ds_run["grads"], torch_run["grads"]), 1):
            assert g_ds.keys() == g_torch.keys()
            for n, v in g_torch.items():
                np.testing.assert_allclose(g_ds[n], v, rtol=0, atol=TOL, err_msg=f"rank {rank} step {step} {n}")
        for n, v in torch_run["params"].items():
            np.testing.assert_allclose(ds_run["params"][n], v, rtol=0, atol=PARAM_TOL, err_msg=f"rank {rank} {n}")


@requires_deepspeed
def test_deepspeed_with_the_bias_equals_one_process(session, single_bias):
    """Issue 43: the global clip norm under ZeRO-2 + EP=2 (ZeRO's norm plus the experts') is one process's; the
    bias moves once per step from the global counts, the same on both ranks and in one process."""
    _, results = session
    got, want = results[0]["zero2_bias"]["losses"], single_bias["losses"]
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([g for _, _, g in got], [g for _, _, g in want], rtol=TOL, atol=0)
    np.testing.assert_allclose([v for _, v, _ in got], [v for _, v, _ in want], rtol=0, atol=TOL)
    assert results[0]["zero2_bias"]["bias"] == results[1]["zero2_bias"]["bias"] == single_bias["bias"]
    assert max(abs(v) for row in single_bias["bias"] for v in row) > 0


@requires_deepspeed
def test_deepspeed_resume_continues_the_exact_trajectory(session):
    tmp, results = session
    resumed, straight = results[0]["resumed"], results[0]["zero2_balancing"]
    assert resumed["start"] == 2
    assert resumed["losses"] == straight["losses"]  # bitwise, each step once (metrics truncated on resume)
    for rank in (0, 1):
        for n, v in results[rank]["zero2_balancing"]["params"].items():
            np.testing.assert_array_equal(results[rank]["resumed"]["params"][n], v, err_msg=f"rank {rank} {n}")
        assert results[rank]["resumed"]["bias"] == results[rank]["zero2_balancing"]["bias"] is not None
    # the run-dir contract
    run_dir = os.path.join(tmp, "resumed")
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["steps"] == STEPS
    with open(os.path.join(run_dir, "run_info.json")) as f:
        info = json.load(f)
    assert info["engine"] == "deepspeed" and info["deepspeed"]["zero_stage"] == 2
    assert info["resumed_from"].endswith("step_000002") and len(info["previous"]) == 1
    from nagmoe.checkpoint import latest_valid_checkpoint, read_checkpoint_state

    latest = latest_valid_checkpoint(run_dir)
    assert latest.endswith("step_000003")
    state = read_checkpoint_state(latest)
    assert state["format"] == "deepspeed-1" and state["layout"] == {"world_size": 2, "ep": 2, "zero_stage": 2}
    files = set(os.listdir(latest))
    assert {"own_rank_00000.pt", "own_rank_00001.pt", "mp_rank_00_model_states.pt",
            "manifest.json", "state.json"} <= files


@requires_deepspeed
def test_a_deepspeed_milestone_holds_the_weights_only(session):
    """Issue 68, item 4: ZeRO 1/2 keep every parameter whole on each rank, so a weights-only milestone is the torch
    engine's (DCP of the model state, experts as DTensors); it reads back in one process as the DeepSpeed
    checkpoint of its step cast by role, and the run it was saved in kept the exact trajectory (above)."""
    from milestone_checks import assert_milestone_is_checkpoint_cast_by_role, stored_dtypes

    from nagmoe.checkpoint import list_milestones, read_checkpoint_state
    from nagmoe.rundir.info import read_saved_config

    tmp, _ = session
    run_dir = os.path.join(tmp, "resumed")
    milestone = os.path.join(run_dir, "milestones", "step_000002")
    assert list_milestones(run_dir) == [(2, milestone)]
    state = read_checkpoint_state(milestone)
    assert state["format"] == "weights-1" and state["layout"] == {"world_size": 2, "ep": 2}
    assert all(k.startswith("model.") for k in stored_dtypes(milestone))
    assert_milestone_is_checkpoint_cast_by_role(read_saved_config(run_dir), milestone,
                                                os.path.join(run_dir, "checkpoints", "step_000002"))


@requires_deepspeed
def test_deepspeed_checkpoint_reads_back_as_one_model(session):
    from nagmoe.model import build_model
    from nagmoe.checkpoint import deepspeed_model_state, latest_valid_checkpoint
    from nagmoe.rundir.info import read_saved_config

    tmp, results = session
    run_dir = os.path.join(tmp, "zero2")
    cfg = read_saved_config(run_dir)
    model = build_model(cfg.model)
    model.load_state_dict(deepspeed_model_state(latest_valid_checkpoint(run_dir)))  # strict: every key
    assert model.blocks[0].ffn.w_in.shape[0] == cfg.model.moe.n_experts == 4
    model.eval()
    with torch.no_grad():
        logits = model(probe_idx()).logits.numpy()
    for rank in (0, 1):
        np.testing.assert_allclose(logits, results[rank]["zero2"]["logits"], rtol=0, atol=TOL)


def run_command(argv, capsys) -> str:
    """`nagmoe ARGV` in this process (the CLI entry); its stdout. Exit 0 required."""
    from nagmoe.cli import main

    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def same_run_as_torch_checkpoint(ds_run: str, torch_run: str) -> str:
    """A torch-engine run dir holding the DeepSpeed run's full state (deepspeed_model_state) as a DCP
    checkpoint of the same step and progress; its config differs only in parallel.engine."""
    from nagmoe.checkpoint import deepspeed_model_state, latest_valid_checkpoint, read_checkpoint_state, save_checkpoint
    from nagmoe.rundir.info import read_saved_config
    from nagmoe.config import dump_yaml
    from nagmoe.model import build_model

    cfg = read_saved_config(ds_run)
    source = latest_valid_checkpoint(ds_run)
    model = build_model(cfg.model)
    model.load_state_dict(deepspeed_model_state(source))
    state = read_checkpoint_state(source)
    cfg.parallel.engine = "torch"
    os.makedirs(torch_run)
    with open(os.path.join(torch_run, "config.yaml"), "w") as f:
        f.write(dump_yaml(cfg))
    return save_checkpoint(torch_run, state["step"], model, extra_state=state["extra"])


@requires_deepspeed
def test_every_reader_command_reads_a_deepspeed_run_like_a_torch_run(session, tmp_path, capsys):
    """eval, generate, analyze and consolidate on the 2-rank EP=2 ZeRO-1 run and on the same state written in
    the torch layout: identical outputs (issue 20)."""
    from nagmoe.checkpoint import read_checkpoint_state
    from nagmoe.checkpoint.consolidate import load_consolidated

    tmp, _ = session
    ds_run, torch_run = os.path.join(tmp, "zero1"), str(tmp_path / "as_torch")
    copy = same_run_as_torch_checkpoint(ds_run, torch_run)
    assert read_checkpoint_state(copy)["format"] == 1
    out = {}
    for name, run_dir in (("deepspeed", ds_run), ("torch", torch_run)):
        eval_json, analysis_json = str(tmp_path / f"{name}-eval.json"), str(tmp_path / f"{name}-analysis.json")
        run_command(["eval", "--run-dir", run_dir, "--offline-items", "8", "--out", eval_json], capsys)
        generated = run_command(["generate", "--run-dir", run_dir, "--prompt", "ROMEO:", "--max-new-tokens", "12",
                                 "--seed", "3"], capsys)
        run_command(["analyze", "--run-dir", run_dir, "--out", analysis_json, "--tokens", "512"], capsys)
        consolidated = run_command(["consolidate", run_dir], capsys).strip()
        where = ("run_dir", "checkpoint")  # the only fields allowed to differ: which run was read
        with open(eval_json) as f:
            evaluation = {k: v for k, v in json.load(f).items() if k not in where}
        with open(analysis_json) as f:
            analysis = {k: v for k, v in json.load(f).items() if k not in where}
        _, weights = load_consolidated(consolidated)
        out[name] = (evaluation, generated, analysis, weights)
    (ds_eval, ds_text, ds_analysis, ds_weights), (t_eval, t_text, t_analysis, t_weights) = \
        out["deepspeed"], out["torch"]
    assert ds_eval == t_eval and ds_text == t_text and ds_analysis == t_analysis
    assert ds_analysis["val_bpb"] > 0 and len(ds_text) > 0
    assert ds_weights.keys() == t_weights.keys()
    for k, v in t_weights.items():
        assert torch.equal(ds_weights[k], v), k


# ----------------------------------------------------------------------------------------------------------
# One process, through the CLI
# ----------------------------------------------------------------------------------------------------------
def nagmoe_cli(args, env=None):
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                             "SLURM_NTASKS")}
    full.update(env or {}, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "nagmoe", *args], cwd=REPO, capture_output=True, text=True,
                          env=full, timeout=300)


@requires_deepspeed
def test_cli_trains_and_resumes_on_deepspeed_in_one_process(micro_overrides, ds_env, tmp_path):
    from nagmoe.rundir.metrics import read_metrics

    run_dir = str(tmp_path / "run")
    args = ["train", "--config", "configs/tiny.yaml", "--run-dir", run_dir, "--quiet", *micro_overrides,
            "train.eval_tokens=256", "parallel.engine=deepspeed", "train.optimizer=adamw"]
    r = nagmoe_cli([*args, "train.max_steps=2"], ds_env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = nagmoe_cli([*args, "train.max_steps=3"], ds_env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(os.path.join(run_dir, "metrics.jsonl"))] == [1, 2, 3]
    with open(os.path.join(run_dir, "run_info.json")) as f:
        assert json.load(f)["resumed_from"].endswith("step_000002")
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000003", "manifest.json"))


@pytest.mark.parametrize("override,message", [
    ("parallel.zero_stage=3", "parallel.zero_stage: 3 is not supported by parallel.engine=deepspeed"),
    ("parallel.zero_stage=0", "parallel.zero_stage: 0 is not supported by parallel.engine=deepspeed"),
    ("model.mod.skip_rate=0.2", "model.mod.skip_rate: 0.2 (Mixture-of-Depths) is not supported by "
                                "parallel.engine=deepspeed"),
])
def test_unsupported_deepspeed_combinations_exit_2(override, message, tmp_path):
    r = nagmoe_cli(["train", "--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), "--quiet",
                    "parallel.engine=deepspeed", "train.optimizer=adamw", override])
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_muon_request_is_refused_on_deepspeed():
    """The DeepSpeed engine runs AdamW: a Muon request (the default train.optimizer) is refused, never silently
    replaced."""
    from nagmoe.config import ConfigError
    from nagmoe.parallel.mesh import validate_parallel

    cfg = load(["parallel.engine=deepspeed"])
    assert cfg.train.optimizer == "muon"
    with pytest.raises(ConfigError, match=r"train.optimizer: 'muon' is not supported by parallel.engine=deepspeed"):
        validate_parallel(cfg, 1)
    cfg.parallel.engine = "torch"
    validate_parallel(cfg, 1)  # the torch engine runs Muon


class ShellPayload:
    """Unpickling this runs `touch MARKER` (what a crafted DeepSpeed file would do through DeepSpeed's loader)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_payload(checkpoint: str, file_name: str, marker: str) -> None:
    """Add a payload to one of DeepSpeed's files and re-record its checksum (anyone can)."""
    import hashlib

    from nagmoe.checkpoint.deepspeed_layout import load_deepspeed_file

    path = os.path.join(checkpoint, file_name)
    state = load_deepspeed_file(path)
    state["extra"] = ShellPayload(marker)
    torch.save(state, path)
    with open(os.path.join(checkpoint, "manifest.json")) as f:
        manifest = json.load(f)
    with open(path, "rb") as f:
        data = f.read()
    manifest["files"][file_name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    with open(os.path.join(checkpoint, "manifest.json"), "w") as f:
        json.dump(manifest, f)


@requires_deepspeed
def test_a_payload_in_deepspeeds_files_is_refused_on_resume(micro_overrides, ds_env, tmp_path):
    """Issue 21: every file DeepSpeed loads goes through weights_only (our checkpoint engine), so a payload in
    the model-states or in a ZeRO optimizer file is refused by `nagmoe train` (resume) with one line naming
    the file and the global, and nothing runs; `nagmoe eval` refuses the model-states one too."""
    import shutil

    from nagmoe.checkpoint import latest_valid_checkpoint

    template = str(tmp_path / "run")
    args = ["--config", "configs/tiny.yaml", "--quiet", *micro_overrides, "train.eval_tokens=256",
            "parallel.engine=deepspeed", "train.optimizer=adamw"]
    r = nagmoe_cli(["train", "--run-dir", template, *args, "train.max_steps=2"], ds_env)
    assert r.returncode == 0, r.stderr[-3000:]
    for file_name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        run_dir, marker = str(tmp_path / file_name), str(tmp_path / f"{file_name}.PWNED")
        shutil.copytree(template, run_dir)
        checkpoint = latest_valid_checkpoint(run_dir)
        plant_payload(checkpoint, file_name, marker)
        commands = [["train", "--run-dir", run_dir, *args, "train.max_steps=3"]]
        if file_name.startswith("mp_rank"):
            commands.append(["eval", "--run-dir", run_dir, "--offline-items", "4"])
        for command in commands:
            r = nagmoe_cli(command, ds_env)
            errors = [line for line in r.stderr.splitlines() if line.startswith(f"nagmoe {command[0]}: error:")]
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert len(errors) == 1 and os.path.join(checkpoint, file_name) in errors[0] \
                and "posix.system" in errors[0], r.stderr[-3000:]
            assert not os.path.exists(marker)
