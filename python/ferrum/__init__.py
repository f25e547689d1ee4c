"""ferrum: a C++ LLM inference engine for Python."""
try:  # first: on a CPU below the build's baseline, an ImportError that says so, not SIGILL
    import ferrum._cpu_check  # noqa: F401
except ModuleNotFoundError:  # a package tree holding _core alone (scripts/dev_test.sh)
    pass
from .llm import LLM
from .lora import LoRARequest
from .async_llm import AsyncLLM
from .outputs import CompletionDelta, CompletionOutput, RequestDelta, RequestOutput
from .sampling import SamplingParams
from .structured import StructuredOutputsParams
from . import eval  # ferrum.eval: perplexity, loglikelihood, exact_match

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "RequestDelta", "CompletionDelta"]
