"""`nagmoe export-hf` on a trained run (issue 42 items 2 and the "Round trip" and "Complete" lines): what it
writes, that it round-trips bitwise, that it refuses what it must, and that a failed check leaves nothing."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from nagmoe.cli import main
from nagmoe.hf.export import PREFIX


def native_run(run_dir, checkpoint=None):
    from nagmoe.eval.generate import load_run

    return load_run(run_dir, "cpu", checkpoint)


def test_the_export_holds_the_model_files_card_and_provenance(exported_run):
    run_dir, out = exported_run
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "modeling_nagmoe.py", "configuration_nagmoe.py", "layers_nagmoe.py",
            "nag_math.py", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md",
            "provenance.json"} <= names
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "nagmoe" and config["tie_word_embeddings"] is False
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_nagmoe.NagMoeForCausalLM"
    assert config["max_seq_len"] == config["nagmoe_model"]["max_seq_len"] and config["seq_len"] == 64
    prov = json.load(open(os.path.join(out, "provenance.json")))
    assert prov["step"] == 12 and len(prov["checkpoint_manifest_sha256"]) == 64
    assert "step 12" in open(os.path.join(out, "README.md")).read()
    assert not [n for n in os.listdir(os.path.dirname(out)) if ".tmp-" in n]  # the temporary sibling is gone


def test_native_to_hf_to_native_is_bitwise(exported_run):
    """The safetensors, prefix stripped, load strictly into a fresh nagmoe model: every tensor equal, same dtype."""
    from nagmoe.model import build_model

    run_dir, out = exported_run
    run = native_run(run_dir)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert all(k.startswith(PREFIX) for k in tensors)
    fresh = build_model(run.config.model)
    fresh.load_state_dict({k[len(PREFIX):]: v for k, v in tensors.items()}, strict=True)
    want, got = run.model.state_dict(), fresh.state_dict()
    assert set(want) == set(got)
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key


def test_loading_reports_nothing_and_keeps_every_dtype(exported_run):
    from transformers import AutoModelForCausalLM

    run_dir, out = exported_run
    model, info = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if k != "error_msgs" and v} == {}
    native = native_run(run_dir).model.state_dict()
    assert {k: v.dtype for k, v in model.state_dict().items()} == {PREFIX + k: v.dtype for k, v in native.items()}
    mod = model.model.stream.mod
    assert mod.histogram.dtype == torch.float64 and mod.skipping.dtype == torch.bool
    assert mod.threshold.dtype == torch.float32
    assert float(model.model.stream.injection_warmup) == 1.0  # a non-persistent buffer, set by _init_weights


def test_a_bf16_export_casts_by_role_and_loads_with_fp32_modules_kept(exported_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, _ = exported_run
    out = str(tmp_path / "bf16")
    assert main(["export-hf", "--run-dir", run_dir, "--out", out, "--dtype", "bfloat16"]) == 0
    tensors = load_file(os.path.join(out, "model.safetensors"))
    low = {k for k, v in tensors.items() if v.dtype == torch.bfloat16}
    assert PREFIX + "wte.weight" in low and PREFIX + "lm_head.weight" in low and PREFIX + "blocks.0.ffn.w_in" in low
    assert not [k for k in low if ".stream." in k or "router" in k or "log_temperature" in k or "conv_" in k]
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16)
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    assert dtypes[PREFIX + "blocks.0.ffn.router.weight"] == torch.float32
    assert dtypes[PREFIX + "stream.gates.0.alpha"] == torch.float32
    assert dtypes[PREFIX + "stream.mod.threshold"] == torch.float32
    assert dtypes[PREFIX + "stream.mod.histogram"] == torch.float64 and dtypes[PREFIX + "stream.mod.skipping"] == torch.bool
    assert dtypes[PREFIX + "blocks.0.attn.c_q.weight"] == torch.bfloat16


def test_the_compute_dial_exports_the_dialled_thresholds(exported_run, tmp_path):
    from nagmoe.eval.generate import set_skip_rate

    run_dir, _ = exported_run
    out = str(tmp_path / "dial")
    assert main(["export-hf", "--run-dir", run_dir, "--out", out, "--skip-rate", "0.1"]) == 0
    run = native_run(run_dir)
    set_skip_rate(run, 0.1)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(tensors[PREFIX + "stream.mod.threshold"], run.model.mod_calibrator().threshold)
    assert json.load(open(os.path.join(out, "provenance.json")))["skip_rate"] == 0.1


def test_a_non_empty_out_is_refused_and_left_as_it_was(exported_run, tmp_path, capsys):
    run_dir, _ = exported_run
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["export-hf", "--run-dir", run_dir, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not an empty directory" in err
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"


def test_a_legacy_precision_run_is_refused_in_one_line(exported_run, tmp_path, capsys):
    run_dir, _ = exported_run
    legacy = tmp_path / "legacy"
    shutil.copytree(run_dir, legacy)
    text = (legacy / "config.yaml").read_text()
    assert "precision: uniform" in text
    (legacy / "config.yaml").write_text(text.replace("precision: uniform", "precision: legacy"))
    assert main(["export-hf", "--run-dir", str(legacy), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "legacy" in err and not os.path.exists(tmp_path / "x")


def test_an_export_that_does_not_reproduce_the_run_leaves_nothing(exported_run, tmp_path, monkeypatch, capsys):
    """The shipped modeling code with RoPE's sine sign flipped: the check (in its own process) must catch it, exit 1
    and leave neither --out nor a temporary behind."""
    import nagmoe.hf.export as hf_export

    run_dir, _ = exported_run
    broken = tmp_path / "hf_broken"
    shutil.copytree(hf_export.HF_DIR, broken)
    layers = broken / "layers_nagmoe.py"
    source = layers.read_text()
    assert "x2 * cos - x1 * sin" in source
    layers.write_text(source.replace("x2 * cos - x1 * sin", "x2 * cos + x1 * sin"))
    monkeypatch.setattr(hf_export, "HF_DIR", str(broken))
    parent = tmp_path / "exports"
    parent.mkdir()
    assert main(["export-hf", "--run-dir", run_dir, "--out", str(parent / "x")]) == 1
    err = capsys.readouterr().err
    assert "does not reproduce the run" in err and "max |Δ log p|" in err
    assert os.listdir(parent) == []


def test_no_validate_skips_the_check(exported_run, tmp_path, capsys):
    run_dir, _ = exported_run
    out = str(tmp_path / "unchecked")
    assert main(["export-hf", "--run-dir", run_dir, "--out", out, "--no-validate"]) == 0
    assert "not checked" in capsys.readouterr().out and os.path.isfile(os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("args,needle", [(["--dtype", "float16"], "invalid choice"),
                                         (["--skip-rate", "1.5"], "--skip-rate")])
def test_bad_arguments_are_one_line(exported_run, tmp_path, capsys, args, needle):
    run_dir, _ = exported_run
    with pytest.raises(SystemExit) if args[0] == "--dtype" else _no_raise():
        assert main(["export-hf", "--run-dir", run_dir, "--out", str(tmp_path / "y"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and not os.path.exists(tmp_path / "y")


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _resume(run_dir, *overrides):
    from nagmoe.config import config_from_dict
    from nagmoe.rundir.info import read_saved_config
    from nagmoe.config.schema import to_dict
    from nagmoe.train.trainer import Trainer

    data = to_dict(read_saved_config(run_dir))
    for item in overrides:
        key, value = item.split("=")
        section, name = key.split(".")
        data[section][name] = {"true": True}.get(value, int(value) if value.isdigit() else value)
    return Trainer(config_from_dict(data), run_dir, quiet=True).run()


def test_export_hf_at_end_writes_run_dir_hf_after_the_final_checkpoint(exported_run, tmp_path):
    run_dir, _ = exported_run
    copy = str(tmp_path / "run")
    shutil.copytree(run_dir, copy)
    _resume(copy, "train.max_steps=13", "train.export_hf_at_end=true")
    prov = json.load(open(os.path.join(copy, "hf", "provenance.json")))
    assert prov["step"] == 13 and os.path.isfile(os.path.join(copy, "hf", "model.safetensors"))
    _resume(copy, "train.max_steps=14", "train.export_hf_at_end=true")  # a later end replaces it
    assert json.load(open(os.path.join(copy, "hf", "provenance.json")))["step"] == 14
    assert not [n for n in os.listdir(copy) if n.startswith(".hf")]


def test_a_failed_export_at_the_end_only_warns(exported_run, tmp_path, monkeypatch, capsys):
    import nagmoe.hf.export as hf_export

    run_dir, _ = exported_run
    copy = str(tmp_path / "run")
    shutil.copytree(run_dir, copy)
    monkeypatch.setattr(hf_export, "HF_DIR", str(tmp_path / "missing"))
    summary = _resume(copy, "train.max_steps=13", "train.export_hf_at_end=true")
    assert summary["steps"] == 13
    err = capsys.readouterr().err
    assert "warning: train.export_hf_at_end" in err and not os.path.exists(os.path.join(copy, "hf"))
    assert not [n for n in os.listdir(copy) if n.startswith(".hf")]


def test_export_hf_at_end_without_transformers_is_refused_before_training(exported_run, tmp_path, monkeypatch):
    import sys

    from nagmoe.base.errors import UserError

    run_dir, _ = exported_run
    copy = str(tmp_path / "run")
    shutil.copytree(run_dir, copy)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the hf extra were not installed
    with pytest.raises(UserError, match="needs the `hf` extra"):
        _resume(copy, "train.max_steps=13", "train.export_hf_at_end=true")
    assert json.load(open(os.path.join(copy, "summary.json")))["steps"] == 12  # nothing trained


def test_an_explicit_checkpoint_is_exported_and_named(exported_run, tmp_path):
    run_dir, _ = exported_run
    ckpt = os.path.join(run_dir, "checkpoints", "step_000012")
    out = str(tmp_path / "explicit")
    assert main(["export-hf", "--run-dir", run_dir, "--out", out, "--checkpoint", ckpt, "--no-validate"]) == 0
    assert json.load(open(os.path.join(out, "provenance.json")))["checkpoint"] == os.path.abspath(ckpt)
    assert main(["export-hf", "--run-dir", run_dir, "--out", str(tmp_path / "none"), "--checkpoint",
                 str(tmp_path / "missing")]) == 2


def test_a_weights_only_milestone_exports(exported_run, tmp_path):
    """Issue 68, item 4: `--checkpoint RUN/milestones/step_N` exports that milestone's weights (checked without
    nagmoe), named as such: its step and tokens, no final bpb, the milestone's dtype."""
    from nagmoe.checkpoint.milestone import low_precision_keys

    run_dir, _ = exported_run
    milestone = os.path.join(run_dir, "milestones", "step_000006")
    out = str(tmp_path / "milestone")
    assert main(["export-hf", "--run-dir", run_dir, "--out", out, "--checkpoint", milestone]) == 0
    prov = json.load(open(os.path.join(out, "provenance.json")))
    assert prov["checkpoint"] == os.path.abspath(milestone) and prov["step"] == 6 and prov["tokens"] == 1536
    assert prov["milestone_dtype"] == "bf16" and prov["val_bpb"] is None
    assert "from a bf16 weights-only milestone" in open(os.path.join(out, "README.md")).read()
    tensors = load_file(os.path.join(out, "model.safetensors"))
    model = native_run(run_dir, milestone).model
    low = low_precision_keys(model)
    for key, t in model.state_dict().items():
        assert torch.equal(tensors[PREFIX + key], t), key  # the milestone's weights, fp32 as exported
        if key in low:
            assert t.dtype == torch.float32 and torch.equal(t, t.to(torch.bfloat16).float()), key
    final = native_run(run_dir).model.state_dict()
    assert not torch.equal(final["blocks.0.ffn.w_in"], model.state_dict()["blocks.0.ffn.w_in"])

