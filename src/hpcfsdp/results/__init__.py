"""Login node: read records, tables, comparison, plots, report. Never imports torch."""
