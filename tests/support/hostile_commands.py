"""One command against every hostile-metadata payload, in this process through the CLI entry (issue 21):

    python hostile_commands.py COMMAND TRAINED_RUN WORK_DIR OUT.json

For each payload: a fresh copy of TRAINED_RUN's run dir (its data symlinked) under WORK_DIR, the payload
written into the newest checkpoint's .metadata (manifest re-recorded), `nagmoe COMMAND ...` run through
`nagmoe.cli.main` with file descriptor 2 captured; records exit code, stderr, whether the marker exists and
whether the process's os/builtins were changed. Writes {payload: record} as JSON."""
import builtins
import json
import os
import shutil
import sys
import tempfile

from hostile_payloads import PAYLOADS, write_payload

COMMANDS = {
    "train": ["train", "--config", "config.yaml", "--run-dir", "run", "--quiet", "train.max_steps=3"],
    "eval": ["eval", "--run-dir", "run", "--offline-items", "4"],
    "generate": ["generate", "--run-dir", "run", "--prompt", "a", "--max-new-tokens", "2"],
    "consolidate": ["consolidate", "run"],
    "analyze": ["analyze", "--run-dir", "run", "--out", "analysis.json", "--tokens", "256"],
    # the report renders what it can and lists a run it cannot read under "problems" (report.json)
    "report": ["report", "run", "--out", "rep", "--eval-items", "4", "--analysis-tokens", "256"],
}


def run_captured(argv: list[str]) -> tuple[int, str]:
    from nagmoe.cli import main

    with tempfile.TemporaryFile(mode="w+") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return rc, err.read()


def main(command: str, trained_run: str, work: str, out: str) -> None:
    from nagmoe.checkpoint import latest_valid_checkpoint

    open_before, sep_before = builtins.open, os.sep
    results = {}
    for name in PAYLOADS:
        root = os.path.join(work, name)
        shutil.copytree(os.path.join(trained_run, "run"), os.path.join(root, "run"))
        shutil.copy(os.path.join(trained_run, "config.yaml"), root)
        os.symlink(os.path.join(trained_run, "data"), os.path.join(root, "data"))
        marker = os.path.join(root, "PWNED")
        checkpoint = latest_valid_checkpoint(os.path.join(root, "run"))
        refused = write_payload(checkpoint, name, marker)
        os.chdir(root)
        rc, err = run_captured(COMMANDS[command])
        problems = []
        if command == "report" and os.path.isfile(os.path.join(root, "rep", "report.json")):
            with open(os.path.join(root, "rep", "report.json")) as f:
                problems = json.load(f)["problems"]
        results[name] = {"rc": rc, "stderr": err, "marker": os.path.exists(marker), "refused": refused,
                         "problems": problems,
                         "metadata": os.path.join("run", os.path.relpath(checkpoint, os.path.join(root, "run")),
                                                  ".metadata"),
                         "process_changed": builtins.open is not open_before or os.sep != sep_before}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
