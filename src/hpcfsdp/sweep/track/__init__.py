"""What happened to queued cells: scheduler, cluster, status, accounting, lost cells, cancel."""
