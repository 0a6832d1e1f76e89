"""The run dir: the one interface between train, eval, report, launch and export (issue 54).

  names.py      every name in a run dir, in one table
  metrics.py    metrics.jsonl: strict JSON lines, appended; truncated back to the checkpoint on resume
"""
