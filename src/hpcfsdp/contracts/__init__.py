"""The contracts both sides read: spec, record, fields, sources, errors, files. Import nothing of either side."""
