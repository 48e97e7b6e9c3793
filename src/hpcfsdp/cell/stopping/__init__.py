"""How a cell stops: signals, requeues, injected faults, the watchdog."""
