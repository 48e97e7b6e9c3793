"""`python -m hpcfsdp.cell.supervise --cell-dir DIR --nproc-per-node N`: the cell's ranks on this
machine under one supervisor, as the local executor and tune's probes start them (entry.py)."""

from __future__ import annotations

import argparse

from .entry import supervise_here


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcfsdp.cell.supervise", description=__doc__)
    parser.add_argument("--cell-dir", required=True, help="a cell folder holding spec.json")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="the ranks to start here")
    args = parser.parse_args()
    raise SystemExit(supervise_here(args.cell_dir, args.nproc_per_node))


if __name__ == "__main__":
    main()
