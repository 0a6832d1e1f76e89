"""Issue 41, build item 5: wandb ids unique per run dir. On c9620be the id was the run dir's base name (with
resume="allow"), so runs/paper/nag-r80-s0 and runs/sweep/nag-r80-s0 (both experiments include sweep-r80.yaml)
shared one wandb run and the second overwrote the first's history. Now a random id is stored in RUN_DIR/wandb_id
at the first start and read back on every resume; a run dir from before (checkpoints, no wandb_id) keeps its base
name so its history continues."""
import os
import re
import shutil

import pytest

from nagmoe.base.errors import UserError
from nagmoe.rundir.wandb_id import WANDB_ID_FILE, ensure_wandb_id, read_wandb_id


def test_two_experiments_same_run_name_get_two_ids(tmp_path):
    paper, sweep = tmp_path / "paper" / "nag-r80-s0", tmp_path / "sweep" / "nag-r80-s0"
    for run in (paper, sweep):
        run.mkdir(parents=True)
        ensure_wandb_id(str(run), resuming=False)
    ids = read_wandb_id(str(paper)), read_wandb_id(str(sweep))
    assert ids[0] != ids[1]
    assert all(re.fullmatch(r"[a-z0-9]{16}", i) for i in ids), ids


def test_a_resume_reads_the_stored_id(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ensure_wandb_id(str(run), resuming=False)
    first = read_wandb_id(str(run))
    ensure_wandb_id(str(run), resuming=True)
    ensure_wandb_id(str(run), resuming=False)  # a restart before the first checkpoint keeps it too
    assert read_wandb_id(str(run)) == first


def test_a_run_dir_from_before_keeps_its_base_name(tmp_path):
    run = tmp_path / "nag-r80-s0"
    run.mkdir()
    ensure_wandb_id(str(run), resuming=True)  # checkpoints, no wandb_id: started before this change
    assert not (run / WANDB_ID_FILE).exists()
    assert read_wandb_id(str(run)) == "nag-r80-s0"


@pytest.mark.parametrize("content", [b"", b"has space\n", b"a/b", b"x" * 2000, b"\xe9\xe9", b"id\nsecond line"])
def test_a_foreign_wandb_id_file_is_one_line(content, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / WANDB_ID_FILE).write_bytes(content)
    with pytest.raises(UserError) as e:
        ensure_wandb_id(str(run), resuming=True)
    assert WANDB_ID_FILE in str(e.value) and len(str(e.value)) <= 600 and "\n" not in str(e.value)


def test_the_trainer_gave_its_run_dir_an_id_and_a_takeover_kept_it(request, tmp_path):
    """The issue's end-to-end run (conftest.py): the first trainer's fresh start wrote the id; the second
    trainer resumed it."""
    run = tmp_path / "run"
    shutil.copytree(request.getfixturevalue("taken_over_run")["run_dir"], run)
    assert re.fullmatch(r"[a-z0-9]{16}", read_wandb_id(str(run)))
    assert (run / WANDB_ID_FILE).is_file() and not os.path.islink(run / WANDB_ID_FILE)
