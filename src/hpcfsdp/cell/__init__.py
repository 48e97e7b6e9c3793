"""Compute node: run one cell (distributed set-up, model, data, strategy, the one loop, metrics)."""
