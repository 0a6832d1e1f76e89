"""Every name in a run dir is defined once, in nagmoe/rundir/names.py (issue 54: they were defined in seven modules
and `"metrics.jsonl"` was a bare literal four more times). A module that spells one of the table's values as a
string of its own instead of importing the name fails here; docstrings and messages that mention a file inside a
longer text are not names."""
import ast
import os

from import_graph import package_modules

from nagmoe.rundir import names

TABLE = {value: key for key, value in vars(names).items() if key.isupper() and isinstance(value, str)}
# names too generic to be a run-dir name wherever they appear as a whole string ("hf", "run", "slurm", "config.yaml"
# are also a Hugging Face folder, a CLI word, a subcommand, an HF config's neighbour); the distinctive ones are checked
DISTINCTIVE = {v for v in TABLE if "." in v or "_" in v} - {"config.yaml"}


def test_the_table_holds_the_run_dirs_names():
    assert {"metrics.jsonl", "run_info.json", "summary.json", "lease.json", "wandb_id", "preempt.request",
            "preempted.json", "jobs.jsonl", "checkpoints", "config.yaml"} <= set(TABLE)
    assert names.HISTORY_FILES == (names.METRICS_FILE, names.RUN_INFO_FILE, names.SUMMARY_FILE, names.EVAL_WINDOWS_FILE)


def test_no_module_spells_a_run_dir_name_of_its_own():
    found = []
    for module, path in package_modules().items():
        if module == "nagmoe.rundir.names":
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        found += [f"{os.path.relpath(path)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and node.value in DISTINCTIVE]
    assert found == []
