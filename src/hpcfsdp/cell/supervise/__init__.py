"""One supervisor process per node starts that node's ranks and watches them (issue 52).

Under Slurm each node runs one task (the array task's CellJob; tune's ProbeJob, a supervisor per
probe in that one process), under `--executor local` and tune's local probes one
`python -m hpcfsdp.cell.supervise --serve` process for all the launches of a submit or a tune stage
(serve.py); either imports the ranks' code once and forks the node's
ranks (start.py: each runs `hpcfsdp run --cell-dir`'s entry, with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT as torchrun gives them: layout.py), watches each rank's process from
outside it (watch.py: its exit, its signal, a stop, a heartbeat that stopped, the kernel's OOM
killer through cgroup.py), writes the cell's record where the ranks could not (ending.py), and ends
the node's other ranks (supervisor.py). A rank that dies or stops has nobody else to speak for it when it is alone.
"""
