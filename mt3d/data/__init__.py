"""Data: tokenizers, indexed token files, sample packing and blending, built-in corpora."""
