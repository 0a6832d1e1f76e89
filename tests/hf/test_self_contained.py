"""The export needs nothing of nagmoe (issue 42, "Self-contained"): the shipped files import only the standard
library, torch, transformers and each other; nag_math.py is nagmoe's own byte for byte; a process where
`import nagmoe` fails and the hub is offline loads an export with the Auto classes and runs it."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

import hf_variants as V
from nagmoe.hf.export import CHECK_SCRIPT, HF_DIR, HF_FILES, compare, native_outputs, run_check

ALLOWED_ROOTS = {"torch", "transformers"}


def imported_roots(path):
    """(absolute import roots, relative import names) of a file, every import statement (lazy ones too)."""
    tree = ast.parse(open(path).read())
    roots, relative = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                relative.add(node.module)
            else:
                roots.add(node.module.split(".")[0])
    return roots, relative


@pytest.mark.parametrize("name", HF_FILES)
def test_shipped_files_import_only_stdlib_torch_transformers_and_siblings(name):
    roots, relative = imported_roots(os.path.join(HF_DIR, name))
    outside = {r for r in roots if r not in ALLOWED_ROOTS and r not in sys.stdlib_module_names}
    assert outside == set(), f"{name} imports {sorted(outside)}"
    siblings = {f[:-3] for f in HF_FILES}
    assert relative <= siblings, f"{name} imports {sorted(relative - siblings)} relatively (not shipped)"


def test_the_import_check_sees_a_nagmoe_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from nagmoe.model import build_model\n")
    assert "nagmoe" in imported_roots(str(bad))[0]


def test_nag_math_is_nagmoes_byte_for_byte(repo_root):
    """One source for the equations: regenerate with `cp nagmoe/ops/nag_math.py nagmoe/hf/remote/nag_math.py`."""
    with open(os.path.join(repo_root, "nagmoe", "ops", "nag_math.py"), "rb") as a, open(os.path.join(HF_DIR, "nag_math.py"),
                                                                                "rb") as b:
        assert a.read() == b.read()


def test_an_in_process_export_of_a_second_variant_loads_without_nagmoe(native_of, tmp_path):
    """The CLI's export (exported_run) is the first variant; this is pre-norm + MHA + dense."""
    cfg, model = native_of("prenorm-mha-dense")
    hf = V.hf_model(cfg, model)
    hf.config.auto_map = {"AutoConfig": "configuration_nagmoe.NagMoeConfig",
                          "AutoModelForCausalLM": "modeling_nagmoe.NagMoeForCausalLM"}
    out = tmp_path / "export"
    hf.save_pretrained(out)
    for name in HF_FILES:
        shutil.copyfile(os.path.join(HF_DIR, name), out / name)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token="<s>").save_pretrained(out)
    ids = V.test_batch()
    got = run_check(str(out), ids, str(tmp_path))  # the export's own check: raises unless it loaded and ran
    assert all(v == [] for v in got["loading_info"].values())
    assert compare(native_outputs(model, ids), got, "float32") == []


def test_the_blocked_process_really_cannot_import_nagmoe(tmp_path):
    """The check would prove nothing if nagmoe stayed importable there."""
    code = ("import runpy, sys; sys.argv = ['x']; ns = runpy.run_path(%r); sys.meta_path.insert(0, ns['_NoNagmoe']());"
            "import nagmoe" % CHECK_SCRIPT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "blocked" in proc.stderr


def test_the_cli_export_ran_its_check_without_nagmoe(exported_run, tmp_path):
    run_dir, out = exported_run
    ids = V.test_batch(rows=2)
    result = run_check(out, ids % 512, str(tmp_path))
    assert result["logits"].shape == (2, V.SEQ, 512)
