"""kernels: hot operations as torch references and Triton versions with the same signatures."""
