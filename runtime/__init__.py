"""runtime: the per-rank engine (receptor -> mu-queues -> scheduler -> executor -> dispatcher) and its adapters."""
