"""hpcfsdp: find the fastest distributed-training setup for a causal LM on a Slurm cluster."""

__version__ = "0.1.0"
