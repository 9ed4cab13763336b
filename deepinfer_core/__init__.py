"""DeepInfer engine core: one LLMEngine, three roles (NORMAL, PROMPT, COMPLETION).

`from deepinfer_core import LLM, SamplingParams` is the offline API. This package
imports no networking (grpc, ray): services build on it.
"""

from deepinfer_core.roles import EngineType
from deepinfer_core.sampling_params import SamplingParams

__all__ = ["EngineType", "SamplingParams", "LLM", "LLMEngine", "EngineArgs", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Lazy: importing the package for EngineType must not pull in torch models.
    if name == "LLM":
        from deepinfer_core.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from deepinfer_core.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineArgs":
        from deepinfer_core.engine_args import EngineArgs

        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        from deepinfer_core import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'deepinfer_core' has no attribute {name!r}")
