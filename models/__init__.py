"""models: the math of each architecture family, weight loading, and the shipped model YAMLs."""
