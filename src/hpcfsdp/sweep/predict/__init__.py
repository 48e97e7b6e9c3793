"""Predicted memory of a cell: GPU memory and host memory per node (no torch)."""
