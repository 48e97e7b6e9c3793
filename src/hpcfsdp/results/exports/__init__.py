"""`hpcfsdp export`: a record to MLflow, TensorBoard and W&B."""
