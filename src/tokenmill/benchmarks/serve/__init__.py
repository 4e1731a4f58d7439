"""Load test of an OpenAI-compatible server: streamed ``/v1/completions`` at several concurrency levels.

For each level, ``--num-prompts`` requests are sent with at most that many in flight (and, with
``--request-rate``, Poisson arrivals at that rate). Every request streams; the client records when each
text chunk arrives. Reported per level: request throughput, output tokens/s, and TTFT (time to the first
text), TPOT (time per output token after the first), ITL (time between chunks) and end-to-end latency, as
mean / p50 / p90 / p99. Output tokens come from the final chunk's usage (``stream_options.include_usage``)
or, where a server sends none, from the number of text chunks.

Works against any OpenAI-compatible server: ``ignore_eos`` / ``min_tokens`` are sent only with
``--ignore-eos``, as extra body fields that servers without them ignore.

    tokenmill serve &
    tokenmill bench serve --url http://127.0.0.1:8000 --concurrency 1,8,32 --num-prompts 64 \\
        --input-len 64 --output-len 64 --ignore-eos --report-dir reports/serve-cpu

The load generator (prompts, one streamed request, a concurrency level) is ``client``; the table, scaling
line and plot are ``report``; the options and the run are ``command``.
"""

from tokenmill.benchmarks.serve.command import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
