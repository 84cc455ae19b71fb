"""Checkpoints: crash-safe saving with manifests, exact resume, resharding, safe loading."""
