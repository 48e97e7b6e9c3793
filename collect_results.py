#!/usr/bin/env python3
"""Turn a sweep's records into comparison tables: `python collect_results.py results/<sweep>`."""

import sys

from hpcfsdp.cli import main

if __name__ == "__main__":
    sys.exit(main(["collect", *sys.argv[1:]]))
