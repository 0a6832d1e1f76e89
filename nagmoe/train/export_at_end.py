"""`train.export_hf_at_end`: after the final checkpoint, rank 0 exports the run's model to RUN_DIR/hf
(nagmoe/hf/export.py, checked without nagmoe like `nagmoe export-hf`). A failed export is a one-line warning:
the run trained and checkpointed, so its exit status does not change. An export already at RUN_DIR/hf (a run
resumed and trained further) is replaced only once the new one has passed its check."""
from __future__ import annotations

import os
import secrets
import shutil
import sys

from nagmoe.base.errors import one_line
from nagmoe.rundir.names import EXPORT_DIR



def check_available(cfg) -> None:
    """At the start, not hours later: the option needs the `hf` extra (UserError, one line)."""
    if cfg.train.export_hf_at_end:
        from nagmoe.hf.export import require_transformers

        require_transformers("train.export_hf_at_end")


def export_at_end(run_dir: str, quiet: bool = False) -> bool:
    """Export to RUN_DIR/hf; True when it was written (and checked), False with a warning otherwise."""
    from nagmoe.hf.export import export_run

    final = os.path.join(run_dir, EXPORT_DIR)
    fresh = os.path.join(run_dir, f".{EXPORT_DIR}.new-{secrets.token_hex(4)}")
    try:
        export_run(run_dir, fresh)
        if os.path.lexists(final):
            old = os.path.join(run_dir, f".{EXPORT_DIR}.old-{secrets.token_hex(4)}")
            os.replace(final, old)
            os.replace(fresh, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(fresh, final)
    except Exception as e:  # noqa: BLE001  (any failure: the training result stands)
        shutil.rmtree(fresh, ignore_errors=True)
        print(one_line(f"[nagmoe] warning: train.export_hf_at_end: the export to {final} failed: "
                       f"{type(e).__name__}: {e}"), file=sys.stderr, flush=True)
        return False
    if not quiet:
        print(f"[nagmoe] exported the model to {final} (Hugging Face, checked without nagmoe)", file=sys.stderr)
    return True
