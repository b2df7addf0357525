"""lowering: passes from (dataflow graph, cluster shape) to a per-rank plan."""
