"""Tensor ops used by replay. Each fast op keeps a plain reference implementation beside it."""
