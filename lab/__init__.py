"""Experiments around the core: the barrier EP baselines, workloads, routing skew, stragglers,
interference processes and the benchmark driver + reports. The core (runtime/) never imports these."""
