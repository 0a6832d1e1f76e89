"""The run dir: the one interface between train, eval, report, launch and export (issue 54). The checkpoints inside
it have their own package (nagmoe/checkpoint/, which imports this one, never the reverse).

  names.py        every name in a run dir, in one table
  info.py         config.yaml (saved config, legacy adoption, resume checks), run_info.json, summary.json
  metrics.py      metrics.jsonl: strict JSON lines, appended; truncated back to the checkpoint on resume
  lease.py        lease.json: one trainer owns a run dir at a time
  permissions.py  --accept-config-change, --take-over, --start-over: what a command may do to an existing run dir
  wandb_id.py     the W&B run id kept in the run dir, so a restart continues the same W&B run
"""
