"""`hpcfsdp tune`: the grid's answer from short probes, several per allocation, and successive halving."""
