"""Tensor ops used by the walk (capture, replay, recompute); each fast op keeps a plain reference beside it."""
