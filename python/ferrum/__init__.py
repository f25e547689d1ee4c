"""ferrum: a C++ LLM inference engine for Python (placeholder; the engine package owns this file)."""
