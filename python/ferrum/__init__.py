"""ferrum: a C++ LLM inference engine for Python."""
from . import _core  # noqa: F401

__version__ = "0.1.0"
