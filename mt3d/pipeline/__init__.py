"""Interleaved pipeline schedules (virtual stages) on DeepSpeed's pipeline engine."""
