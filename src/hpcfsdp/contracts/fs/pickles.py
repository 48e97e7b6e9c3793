"""Job pickles (submitit's `<job>_submitted.pkl`) written with their sha256 and unpickled only when
the bytes read are the bytes written: a pickle runs code when it is loaded, and a shared sweep
folder (HPCFSDP_SHARED_GROUP) lets another user replace it while the job waits. The digest
travels in the sbatch script, which Slurm copies at submission (sweep/launch/digested.py)."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from pathlib import Path
from typing import Any

from .beneath import read_file, replacing

# submitit's pickle of one cell's job is some 1 KB; far more is no pickle of hpcfsdp's.
MAX_PICKLE_BYTES = 16 << 20


class DigestMismatch(ValueError):
    """The pickle's bytes are not those the job was submitted with: nothing was unpickled."""


def write_pickle(path: str | Path, data: bytes) -> str:
    """Write data at path (0600, by a rename: a link at the name is replaced, never followed);
    its sha256 in hex."""
    with replacing(path, mode=0o600) as (_, fd, _):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    return hashlib.sha256(data).hexdigest()


def load_pickle(path: str | Path, sha256: str) -> Any:
    """The object pickled at path, read once (a regular file, no link followed, at most
    MAX_PICKLE_BYTES) and unpickled from those bytes only where their sha256 is `sha256`;
    DigestMismatch otherwise, before a byte is unpickled."""
    data = read_file(path, MAX_PICKLE_BYTES)
    found = hashlib.sha256(data).hexdigest()
    if not hmac.compare_digest(found, sha256.lower()):
        raise DigestMismatch(
            f"{path}: digest mismatch (its sha256 is {found[:16]}..., the job's sbatch script carries "
            f"{sha256[:16] or 'none'}...): the job pickle was replaced after submit, not unpickled"
        )
    return pickle.loads(data)
