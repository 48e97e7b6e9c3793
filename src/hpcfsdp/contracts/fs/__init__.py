"""The file layer's base, below the contracts: folders opened through their descriptors, no link
followed (beneath), and whose a file is and who holds a lock (ownership). Imports nothing of
hpcfsdp: contracts/files.py builds the suite's writers, readers and locks on it."""
