"""Cluster launchers: `slurm` renders and submits the sbatch templates of `launch/`."""
