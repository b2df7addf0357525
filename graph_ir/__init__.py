"""graph_ir: what a model is. The ModelSpec and the token-level dataflow graph built from it."""
from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec, load_spec, spec_from_dict

__all__ = ["ModelSpec", "UserError", "load_spec", "spec_from_dict"]
