"""`python -m hpcfsdp.cell.supervise --cell-dir DIR --nproc-per-node N`: the cell's ranks on this
machine under one supervisor (entry.py). `--serve FD`: the local executor's supervisor, kept for
every launch of one submit or tune stage, asked for each over the socket FD (serve.py)."""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcfsdp.cell.supervise", description=__doc__)
    parser.add_argument("--cell-dir", help="a cell folder holding spec.json")
    parser.add_argument("--nproc-per-node", type=int, help="the ranks to start here")
    parser.add_argument("--serve", type=int, metavar="FD", help="run the launches asked for over this socket")
    args = parser.parse_args()
    if args.serve is not None:
        from .serve import serve

        raise SystemExit(serve(args.serve))
    if args.cell_dir is None or args.nproc_per_node is None:
        parser.error("--cell-dir and --nproc-per-node are required without --serve")
    from .entry import supervise_here

    raise SystemExit(supervise_here(args.cell_dir, args.nproc_per_node))


if __name__ == "__main__":
    main()
