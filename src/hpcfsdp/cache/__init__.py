"""Login / head node: hub references, download, verify, manifest. Only tokenising imports transformers."""
