"""ferrum: a C++ LLM inference engine for Python."""
# Deliberately no eager `from . import _core`: the pure-Python modules
# (sampling, stop, outputs) must import without the compiled extension.
__version__ = "0.1.0"
