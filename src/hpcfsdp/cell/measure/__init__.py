"""What a cell measures and records: metrics, provenance, the summary."""
