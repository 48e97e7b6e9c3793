"""The jobs YAML -> a Sweep of cells: the matrix, `slurm:` resources, the container value."""
