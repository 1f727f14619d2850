"""snowcat: slurm."""
