"""Cells to an executor: plan, preflight, sbatch arrays, the local executor, the job, its environment."""
