"""jengine: vLLM's serving engine rebuilt on JAX/XLA."""

__version__ = "0.1.0"

from jengine.llm import LLM  # noqa: E402
from jengine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from jengine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
