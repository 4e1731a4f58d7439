"""Building engines over an already-loaded model, so tests do not reload weights per config."""

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.llm import LLM
from tokenmill.loading import LoadedModel
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams


def engine_for(loaded: LoadedModel, **options: Any) -> LLMEngine:
    options.setdefault("device", "cpu")
    options.setdefault("cpu_kv_cache_gib", 0.25)
    return LLMEngine(EngineConfig().with_options(**options), loaded=loaded)


def llm_for(loaded: LoadedModel, **options: Any) -> LLM:
    return LLM(engine=engine_for(loaded, **options))


def run_to_completion(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    outputs = {}
    for request_id, (prompt, params) in requests.items():
        ids = engine.add_request(request_id, prompt, params)
        outputs[request_id] = RequestOutput(
            request_id, None, ids, [CompletionOutput(i) for i in range(params.n)]
        )
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id].apply(delta)
    return outputs


T = TypeVar("T")


def in_thread(function: Callable[[], T]) -> T:
    """``function()`` run in a fresh thread: with the CPU oversubscribed (other jobs on the machine), torch's
    OpenMP runs the model many times slower in pytest's main thread than in any other."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(function())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]
