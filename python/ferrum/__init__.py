"""ferrum: a C++ LLM inference engine for Python."""

__version__ = "0.1.0"
