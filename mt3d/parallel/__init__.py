"""Parallelism core: rank mapper, process groups, TP collectives and layers, RNG, harness."""
