#!/usr/bin/env python3
"""Pre-download models, tokenizers and datasets for offline compute nodes: `python download_models.py jobs/X.yaml`.

Same as `hpcfsdp download` (see docs/download.md).
"""

import sys

from hpcfsdp.cli import main

if __name__ == "__main__":
    sys.exit(main(["download", *sys.argv[1:]]))
