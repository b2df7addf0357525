"""dataflow: the CLI and the small public API that ties graph_ir -> lowering -> runtime together."""
