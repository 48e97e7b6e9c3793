"""Save the weights a cell of `hpcfsdp run` starts from (a preset, seeded random init, the same
code path as the cell: cell/models.build_model) as a Hugging Face checkpoint folder, so that both
sides of bench/versus_torchtitan.sh can start from identical weights: torchtitan through
`--checkpoint.initial_load_path DIR --checkpoint.initial_load_in_hf`, hpcfsdp through
`init=pretrained model=DIR` (or its own random init with the same seed, which is the same).

Why: torchtitan initialises Qwen3 its own way (depth-scaled output projections, a truncated normal
tied embedding), and the GPU's clock under its power limit depends on the values it computes with.

    python3 bench/hf_checkpoint.py qwen3-1.7b /tmp/weights [--seed 0] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from hpcfsdp.cell.models import build_model, resolve_model
from hpcfsdp.contracts.sources import model_source
from hpcfsdp.contracts.spec import RunSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", help="a model preset of hpcfsdp (qwen3-1.7b, tiny, ...)")
    parser.add_argument("folder", help="the checkpoint folder to write (config.json, *.safetensors)")
    parser.add_argument("--seed", type=int, default=RunSpec.seed, help="RunSpec's seed (default: its default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    started = time.monotonic()
    model = build_model(resolve_model(model_source(args.preset)), torch.float32, torch.device(args.device), args.seed)
    model.save_pretrained(args.folder, safe_serialization=True)
    count = sum(p.numel() for p in model.parameters())
    print(
        f"[hf_checkpoint] {args.preset} seed {args.seed}: {count:,} parameters -> {args.folder} "
        f"({time.monotonic() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()
