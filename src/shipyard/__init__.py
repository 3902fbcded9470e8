"""shipyard: an open, reproducible language-model training stack in JAX."""

__version__ = "0.1.0"
