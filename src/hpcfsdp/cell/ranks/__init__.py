"""The ranks of a cell: torch.distributed set-up and collectives."""
