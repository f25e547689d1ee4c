"""ferrum: a C++ LLM inference engine for Python."""
from .llm import LLM
from .async_llm import AsyncLLM
from .outputs import CompletionDelta, CompletionOutput, RequestDelta, RequestOutput
from .sampling import SamplingParams
from .structured import StructuredOutputsParams
from . import eval  # ferrum.eval: perplexity, loglikelihood, exact_match

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "RequestDelta", "CompletionDelta"]
