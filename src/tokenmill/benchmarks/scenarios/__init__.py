"""Scheduling-feature scenarios: five workloads, each run with its feature off and on in the same run.

    tokenmill bench scenarios [--workload all|continuous_batching|burst|chunked_prefill|prefix_caching|
                              multi_turn] [--driver offline|serve] [--url URL [--url URL]]
                              [--preset auto|cpu|gpu] [--<size> N ...] [--model M --load-format dummy
                              --device cuda ...] [--report-dir DIR]

| workload              | arrivals                                          | feature toggled               |
|-----------------------|---------------------------------------------------|-------------------------------|
| `continuous_batching` | mixed prompt/output lengths, Poisson              | `batching` static, continuous |
| `burst`               | the same kind of requests, all at t=0             | `batching` static, continuous |
| `chunked_prefill`     | short-prompt streams, long prompts (75%) join     | `chunked_prefill` + budget    |
| `prefix_caching`      | one shared prefix, distinct suffixes, Poisson     | `prefix_caching`              |
| `multi_turn`          | conversations re-sending their history every turn | `prefix_caching`              |

Why a command of its own rather than a ``--workload`` on ``bench serve``: ``bench serve`` measures one
server someone else started, at several concurrency levels; a scenario is a workload *and* the engine
config pair it compares, so it has to own the engine (or be handed two servers). Its flags follow
``bench serve`` / vLLM's ``vllm bench serve`` where they mean the same (``--url``, ``--api-key``,
``--seed``, ``--report-dir``; request rates are Poisson arrivals per second).

Two drivers replay the same workload definitions:

- ``offline`` (default): an in-process ``LLMEngine`` stepped in a loop; a request is added when its
  arrival time has come, and every new token is stamped with the time its step returned. No HTTP, so
  this driver imports neither FastAPI, uvicorn nor httpx.
- ``serve``: tokenmill's OpenAI-compatible server started in this process for each config (over the
  model loaded once) and driven over 127.0.0.1 by ``bench serve``'s streaming client; or, with
  ``--url``, servers already running (two URLs: feature off, then on). It needs a model with a tokenizer
  (the server streams text), so not dummy weights.

Per config: TTFT and ITL percentiles (p50/p90/p99), output tok/s and requests/s, and on/off ratios; the
target of a workload, where it has one, is checked on the measured numbers (chunked_prefill: ITL p99
within 3x its p50 with the feature on; prefix_caching: TTFT p50 cut at least 2x and throughput raised).
Greedy outputs must be identical off and on (token ids offline, text over HTTP); a workload where they
are not gets no numbers, its differences are printed, and the command exits non-zero. Written to the
report folder: scenarios.md (starting with its provenance: commit, command, machine, date),
scenarios.json and a PNG per workload. The folder is ``--report-dir``, else
``scenarios-<device>-<driver>`` (``scenarios-url`` with ``--url``) in ``$TOKENMILL_REPORT_DIR`` or
``~/.cache/tokenmill/reports``: never the source tree unless named.

Sizes come from a preset (``cpu``: all five in about ten minutes on two cores with the default model;
``gpu``: 48 requests on a 1024-token prefix, 4096-token prompts among streams, ...), each overridable by
its own flag (``--prefix-len 1024``, ``--batching-rate 4``; see ``--help``). Examples:

    tokenmill bench scenarios --workload prefix_caching --threads 1
    tokenmill bench scenarios --model qwen3-0.6b --load-format dummy --device cuda --dtype float32
    tokenmill bench scenarios --workload chunked_prefill --driver serve
    tokenmill bench scenarios --workload prefix_caching --url http://127.0.0.1:8000 --url http://127.0.0.1:8001
"""

from tokenmill.benchmarks.scenarios.command import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
