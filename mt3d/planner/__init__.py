"""Parallelism planner: memory / communication / bubble model and layout search (mt3d plan)."""
