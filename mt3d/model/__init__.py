"""Model definitions: architecture config, transformer blocks, pipeline assembly, HF adapters."""
