"""Login node: YAML matrix -> cells -> Slurm arrays or local runs; status. Never imports torch."""
