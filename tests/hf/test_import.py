"""`nagmoe import-hf` (issue 42 item 3): an export back into a run dir; HF -> native -> HF equal; the export's
Python never runs; broken exports are one line, exit 2, nothing written."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nagmoe.cli import main


@pytest.fixture(scope="module")
def imported(exported_run, tmp_path_factory):
    _, out = exported_run
    run_dir = str(tmp_path_factory.mktemp("imported") / "run")
    assert main(["import-hf", out, "--run-dir", run_dir]) == 0
    return out, run_dir


def test_hf_to_native_to_hf_keeps_tensors_and_metadata(imported, tmp_path):
    out, run_dir = imported
    again = str(tmp_path / "again")
    assert main(["export-hf", "--run-dir", run_dir, "--out", again]) == 0
    a, b = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(again, "model.safetensors"))
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (out, again))
    for key in ("nagmoe_model", "layout", "seq_len", "precision", "bos_token_id", "eos_token_id", "vocab_size"):
        assert ca[key] == cb[key], key
    assert open(os.path.join(out, "tokenizer.json")).read() == open(os.path.join(again, "tokenizer.json")).read()


def test_generate_and_eval_read_the_imported_run(imported, exported_run, capsys):
    out, run_dir = imported
    original, _ = exported_run
    assert main(["generate", "--run-dir", run_dir, "--prompt", "ROMEO:", "--temperature", "0",
                 "--max-new-tokens", "12"]) == 0
    imported_text = capsys.readouterr().out
    assert main(["generate", "--run-dir", original, "--prompt", "ROMEO:", "--temperature", "0",
                 "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == imported_text


def test_analyze_without_data_is_one_line(imported, tmp_path, capsys):
    _, run_dir = imported
    assert main(["analyze", "--run-dir", run_dir, "--out", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no prepared data" in err


def test_the_exports_python_never_runs(exported_run, tmp_path):
    _, out = exported_run
    planted = tmp_path / "planted"
    shutil.copytree(out, planted)
    marker = tmp_path / "ran"
    for name in ("modeling_nagmoe.py", "configuration_nagmoe.py", "layers_nagmoe.py", "nag_math.py"):
        (planted / name).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert main(["import-hf", str(planted), "--run-dir", str(tmp_path / "run")]) == 0
    assert not marker.exists()


def _broken(out, tmp_path, edit):
    d = tmp_path / "broken"
    shutil.copytree(out, d)
    edit(d)
    return str(d)


def _config_edit(change):
    def edit(d):
        c = json.load(open(d / "config.json"))
        change(c)
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _drop_tensor(d):
    t = load_file(str(d / "model.safetensors"))
    t.pop("model.stream.g_encode")
    save_file(t, str(d / "model.safetensors"))


def _drop(*names):
    def edit(d):
        t = load_file(str(d / "model.safetensors"))
        for name in list(t):
            if any(name.startswith(prefix) for prefix in names):
                t.pop(name)
        save_file(t, str(d / "model.safetensors"))
    return edit


def _add_tensor(d):
    t = load_file(str(d / "model.safetensors"))
    t["model.extra.weight"] = torch.zeros(3)
    save_file(t, str(d / "model.safetensors"))


def _reshape_tensor(d):
    t = load_file(str(d / "model.safetensors"))
    t["model.wte.weight"] = t["model.wte.weight"][:-1].contiguous()
    save_file(t, str(d / "model.safetensors"))


@pytest.mark.parametrize("edit,needle", [
    (_config_edit(lambda c: c.update(model_type="llama")), "is not 'nagmoe'"),
    (_config_edit(lambda c: c["nagmoe_model"].update(d_model="x" * 100000)), "model.d_model"),
    (_config_edit(lambda c: c["nagmoe_model"].update(n_layers=[[[]]])), "model.n_layers"),
    (_config_edit(lambda c: c.pop("seq_len")), "seq_len"),
    (lambda d: (d / "config.json").write_text("[" * 100000), "nested too deeply"),
    (lambda d: (d / "tokenizer.json").write_text("{nope"), "tokenizer"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "safetensors"),
    (_drop_tensor, "1 missing: 'model.stream.g_encode'"),
    # the largest tensor: the sizes disagree first, and the line still names it (issue 61)
    (_drop("model.wte.weight"), "1 missing: 'model.wte.weight'"),
    (_drop("model.blocks."), " more"),  # every block's tensors: the first few by name, then a count
    (_add_tensor, "1 unexpected: 'model.extra.weight'"),
    (_reshape_tensor, "1 mis-shaped: 'model.wte.weight' has shape"),
])
def test_a_broken_export_is_one_line_and_writes_nothing(exported_run, tmp_path, capsys, edit, needle):
    _, out = exported_run
    src = _broken(out, tmp_path, edit)
    run_dir = tmp_path / "run"
    assert main(["import-hf", src, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and len(err) < 600, err
    assert not run_dir.exists() or os.listdir(run_dir) == []


def test_a_non_empty_run_dir_is_refused(exported_run, tmp_path, capsys):
    _, out = exported_run
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep").write_text("x")
    assert main(["import-hf", out, "--run-dir", str(tmp_path / "run")]) == 2
    assert os.listdir(tmp_path / "run") == ["keep"]


def test_import_leaves_torchs_global_generator_alone(exported_run, tmp_path):
    """A library call must not reseed the caller's RNG (the weights come from the file, not a draw)."""
    from nagmoe.hf.importer import import_export

    _, out = exported_run
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    import_export(out, str(tmp_path / "run"))
    assert torch.equal(torch.get_rng_state(), before)
