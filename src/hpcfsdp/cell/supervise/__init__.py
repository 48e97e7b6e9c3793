"""One supervisor process per node starts that node's ranks and watches them (issue 52).

Under Slurm each node runs one task (the array task's CellJob), under `--executor local` and tune's
probes one `python -m hpcfsdp.cell.supervise` process; either starts the node's ranks
(`hpcfsdp run --cell-dir`, with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as
torchrun gives them: layout.py), watches each rank's process from outside it (watch.py: its exit,
its signal, a stop, a heartbeat that stopped, the kernel's OOM killer through cgroup.py), writes the
cell's record where the ranks could not (ending.py), and ends the node's other ranks
(supervisor.py). A rank that dies or stops has nobody else to speak for it when it is alone.
"""
