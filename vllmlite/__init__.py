"""vllmlite: a readable LLM inference server in Python and numpy."""

from vllmlite import threads  # noqa: F401  (first: sets the thread pools' environment before numpy loads)

# isort: split
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine_args import EngineArgs
from vllmlite.llm import LLM
from vllmlite.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from vllmlite.pooling_params import PoolingParams
from vllmlite.sampling_params import SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.version import __version__

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "EmbeddingOutput", "Logprob", "__version__"]
