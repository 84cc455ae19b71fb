"""Training: process set-up, engine construction, the loop, metrics and W&B."""
