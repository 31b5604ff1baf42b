"""OpWeave: a compiler for LLM decode serving on mixed GPU clusters."""

__version__ = "0.1.0"
