"""Launching runs (issue 54): what sits above a single training process.

  slurm.py          renders and submits the sbatch templates of `launch/` (the repository's folder)
  pinned_config.py  the config a queued job trains, pinned by its hash; jobs.jsonl
  experiment.py     `nagmoe experiment FILE`: the runs x seeds of an experiment, in-process or as Slurm jobs, and
                    the report (the one launch module that imports the trainer)
"""
