"""The sweep folder's layout, read by launch, track and results."""
