"""Every way a request can go wrong, answered in OpenAI's error format with the right status and never a
5xx for bad input: validation, unknown models, context limits, API keys, backpressure, timeouts, engine
failures, and a fuzz of random JSON bodies."""

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion

from engine_helpers import engine_for
from tokenmill.server import ServerSettings, ServerThread, create_app
from tokenmill.server.generation import ServerContext

MODEL = "smollm2-errors"
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def server(smollm2) -> Iterator[ServerThread]:  # type: ignore[no-untyped-def]
    engine = engine_for(
        smollm2, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, cpu_kv_cache_gib=0.05
    )
    app = create_app(engine, ServerSettings(served_model_name=MODEL, api_key=API_KEY))
    with ServerThread(app) as thread:
        yield thread


@pytest.fixture(scope="module")
def context(server: ServerThread) -> ServerContext:
    ctx: ServerContext = server.app.state.context
    return ctx


@pytest.fixture
def with_settings(context: ServerContext) -> Iterator[Callable[..., None]]:
    """Change the server's settings for one test."""
    original = context.settings

    def change(**fields: Any) -> None:
        context.settings = replace(original, **fields)

    yield change
    context.settings = original


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server: ServerThread, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def engine_is_idle(context: ServerContext) -> bool:
    stats = context.engine_loop.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0


def test_unknown_model_is_a_404(client: openai.OpenAI, server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-17", prompt="Hi", max_tokens=2)
    assert "gpt-17" in caught.value.message
    assert_error(
        post(server, "/v1/chat/completions", {"model": "x", "messages": [{"role": "user"}]}), 404, "model"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0),
        ("logprobs", 21),
        ("min_tokens", -1),
        ("stop", [""]),
        ("logit_bias", {"not-an-id": 1}),
        ("logit_bias", {"5": 1000}),
        ("logit_bias", {"1_0": 1}),  # int() reads these two as 10
        ("logit_bias", {" 10 ": 1}),
        ("temperature", "0"),  # numbers are numbers: no strings or booleans in their place
        ("temperature", True),
        ("top_p", "0.5"),
        ("presence_penalty", False),
        ("seed", "7"),
        ("n", 1000),
        ("priority", "high"),
        ("priority", 1.5),
        ("priority", True),
        ("priority", 3),  # an integer, but this server schedules first come, first served
    ],
)
def test_invalid_parameters_are_400s_naming_the_parameter(
    server: ServerThread, field: str, value: Any
) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, field: value}
    error = assert_error(post(server, "/v1/completions", body), 400, field)
    assert error["type"] == "invalid_request_error"


def test_invalid_chat_parameters_are_400s(server: ServerThread) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    for extra, param in [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"priority": "1"}, "priority"),
        ({"priority": -2}, "priority"),
    ]:
        assert_error(post(server, "/v1/chat/completions", {"messages": messages, **extra}), 400, param)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(server, "/v1/chat/completions", {"messages": image}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")


def test_prompt_beyond_the_context_is_a_400_with_both_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[1] * 100, max_tokens=50)
    message = caught.value.message
    assert "100" in message and "50" in message and str(MAX_MODEL_LEN) in message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1] * 200, max_tokens=1)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {"prompt": 42}, "prompt"),
        ("/v1/completions", {"prompt": [1, "two"]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages.0.role"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/generate", {"max_tokens": 2}, "prompt"),
        # a lone surrogate is not Unicode: no tokenizer takes it
        ("/v1/completions", {"prompt": "Hi \ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["Hi", "\udfff there"]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ("/generate", {"prompt": "\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": "1"}}, "logit_bias.5"),
        (
            "/v1/completions",
            {"prompt": "Hi", "structured_outputs": {"regexx": "a"}},
            "structured_outputs.regexx",
        ),
        (
            "/v1/completions",
            {"prompt": "Hi", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        # continuing a final message: the same checks as on the chat route
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True},
            "continue_final_message",
        ),
        # a request's own template: refused as a field and inside chat_template_kwargs
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "chat_template_kwargs": {"chat_template": "{{ 'x' }}"},
            },
            "chat_template_kwargs",
        ),
    ],
)
def test_malformed_bodies_are_400s(server: ServerThread, path: str, body: Any, param: str | None) -> None:
    assert_error(post(server, path, body), 400, param)


def test_text_too_long_for_the_context_is_refused_before_tokenizing(
    server: ServerThread, context: ServerContext
) -> None:
    """Longer than the context holds even at the vocabulary's longest token per position: a 400 at once,
    without tokenizing it (for megabytes of text that takes seconds)."""
    longest = MAX_MODEL_LEN * context.tokenizer.max_token_chars
    error = assert_error(post(server, "/v1/completions", {"prompt": "x" * (longest + 1)}), 400, "prompt")
    assert f"{longest + 1:,} characters" in error["message"], error
    chat = {"messages": [{"role": "user", "content": "y" * (longest + 1)}]}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "messages")
    # at the bound it is tokenized, and refused for its token count as any long prompt is
    error = assert_error(post(server, "/v1/completions", {"prompt": "x" * longest, "max_tokens": 1}), 400)
    assert "characters" not in error["message"] and str(MAX_MODEL_LEN) in error["message"], error


def test_created_is_the_time_of_the_request(client: openai.OpenAI, context: ServerContext) -> None:
    wait_until(lambda: int(time.time()) > context.created)  # at most a second after the server started
    before = int(time.time())
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert before <= completion.created <= time.time() and before <= chat.created <= time.time()


def test_api_key_is_required_on_model_routes(server: ServerThread) -> None:
    body = {"prompt": "Hi", "max_tokens": 1}
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(post(server, "/v1/completions", body, headers), 401)
    assert_error(httpx.get(f"{server.base_url}/v1/models"), 401)
    unauthorised = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unauthorised.models.list()
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def _long_stream(client: openai.OpenAI) -> openai.Stream[Completion]:
    return client.completions.create(
        model=MODEL, prompt="Count:", max_tokens=100, stream=True, extra_body={"ignore_eos": True}
    )


def test_full_waiting_queue_is_a_503_with_retry_after(
    server: ServerThread, client: openai.OpenAI, context: ServerContext, with_settings: Callable[..., None]
) -> None:
    with_settings(max_waiting=0)
    streams = [_long_stream(client) for _ in range(MAX_NUM_SEQS)]  # each returns once it has a token
    try:
        wait_until(lambda: context.engine_loop.stats().num_running == MAX_NUM_SEQS)
        response = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert_error(response, 503)
        assert int(response.headers["Retry-After"]) >= 1
    finally:
        for stream in streams:
            stream.close()
    wait_until(lambda: engine_is_idle(context))
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_timeout_is_a_504_and_aborts_the_request(
    server: ServerThread, client: openai.OpenAI, context: ServerContext, with_settings: Callable[..., None]
) -> None:
    with_settings(request_timeout_s=0.5)
    body = {"prompt": "Count:", "max_tokens": 100, "ignore_eos": True}
    assert_error(post(server, "/v1/completions", body), 504)
    wait_until(lambda: engine_is_idle(context), timeout_s=5)
    with pytest.raises(openai.APIError, match="timeout"):  # streamed: the deadline passes mid-stream
        for _ in _long_stream(client):
            pass
    wait_until(lambda: engine_is_idle(context), timeout_s=5)


def test_engine_exception_fails_requests_in_flight_with_500_and_the_server_recovers(
    server: ServerThread, client: openai.OpenAI, context: ServerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = context.engine.runner
    real_execute = runner.execute
    failures = iter([True])

    def execute_that_fails_once(*args: Any, **kwargs: Any) -> Any:
        if next(failures, False):
            raise RuntimeError("injected failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute_that_fails_once)
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    wait_until(lambda: engine_is_idle(context))
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).usage.completion_tokens > 0  # type: ignore[union-attr]


def test_a_dead_engine_loop_makes_health_503(smollm2) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(smollm2, max_model_len=64, cpu_kv_cache_gib=0.01)
    app = create_app(engine, ServerSettings(served_model_name=MODEL))
    with ServerThread(app) as thread:
        assert httpx.get(f"{thread.base_url}/health").status_code == 200

        def broken() -> bool:
            raise RuntimeError("the loop itself broke")

        engine.has_unfinished_requests = broken
        wait_until(lambda: httpx.get(f"{thread.base_url}/health").status_code == 503, timeout_s=10)
        assert "the loop itself broke" in httpx.get(f"{thread.base_url}/health").text
        response = httpx.post(f"{thread.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert_error(response, 503)


def test_disconnected_non_streaming_client_is_aborted(server: ServerThread, context: ServerContext) -> None:
    max_tokens = MAX_MODEL_LEN - 8

    async def leave_early() -> None:
        async with httpx.AsyncClient(headers=AUTH) as http:
            body = {"prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True}
            request = http.post(f"{server.base_url}/v1/completions", json=body)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(request, timeout=1.0)

    tokens_before = generation_tokens(server)
    asyncio.run(leave_early())
    wait_until(lambda: engine_is_idle(context), timeout_s=30)
    assert generation_tokens(server) - tokens_before < max_tokens  # aborted, not run to the end


def generation_tokens(server: ServerThread) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith("tokenmill:generation_tokens_total "):
            return float(line.split(" ")[1])
    raise AssertionError("no tokenmill:generation_tokens_total in /metrics")


# -- fuzz ---------------------------------------------------------------------------------------------

_JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "n", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logprobs", "top_logprobs", "echo", "ignore_eos", "min_tokens", "stream",
    "stream_options", "logit_bias", "user", "tokens", "best_of", "suffix",
]  # fmt: skip
_NUMBERS = st.floats(-1, 3) | st.sampled_from([0, 1, 1e-300, 1e308, -1e-9, 2**63, float("nan"), float("inf")])
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_CONTENT = st.text(max_size=20) | st.lists(st.fixed_dictionaries({"type": st.text(max_size=6)})) | _JSON
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"])}, optional={"content": _CONTENT}
)
_PLAUSIBLE = {
    "model": st.just(MODEL) | st.text(max_size=5),
    "user": st.text(max_size=5) | _JSON_SCALARS,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 60000), max_size=5) | _JSON,
    "messages": st.lists(_MESSAGE, max_size=3) | _JSON,
    # Few tokens whenever the rest is valid, so that valid examples stay quick.
    "max_tokens": st.integers(-2, 3) | st.sampled_from([None, "2", 2.0, 10**30]),
    "max_completion_tokens": st.integers(-2, 3) | _JSON_SCALARS,
    "n": st.integers(-1, 3) | _JSON_SCALARS,
    "stream": st.booleans() | _JSON_SCALARS,
    "seed": st.integers(-(2**70), 2**70) | _JSON_SCALARS,
    "top_k": st.integers(-3, 10**6) | _JSON_SCALARS,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | _JSON_SCALARS,
    "stop_token_ids": st.lists(st.integers(-1, 60000), max_size=3) | _JSON_SCALARS,
    "logprobs": st.integers(-1, 25) | st.booleans() | _JSON_SCALARS,
    "top_logprobs": st.integers(-1, 25) | _JSON_SCALARS,
    "min_tokens": st.integers(-1, 4) | _JSON_SCALARS,
    "logit_bias": st.dictionaries(st.integers(-1, 60000).map(str), _NUMBERS, max_size=3) | _JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _JSON,
    **{name: st.booleans() | _JSON_SCALARS for name in ("echo", "ignore_eos")},
    **dict.fromkeys(_FLOAT_FIELDS, _NUMBERS | _JSON_SCALARS),
}


_PROMPT = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
_VALID_BODIES = {"/v1/completions": _PROMPT, "/v1/chat/completions": _CHAT, "/generate": _PROMPT}
_VALID_BODIES["/tokenize"] = {"messages": _CHAT["messages"]}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, Any]:
    """A route and a body: any JSON; random fields with plausible or arbitrary values; or a valid body
    with a few fields changed or added."""
    path = draw(st.sampled_from(sorted(_VALID_BODIES)))
    kind = draw(st.sampled_from(["any", "random", "mutated", "mutated"]))
    if kind == "any":
        return path, draw(_JSON)
    body: dict[str, Any] = dict(_VALID_BODIES[path]) if kind == "mutated" else {}
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=3 if kind == "mutated" else 8, unique=True)):
        body[name] = draw(_PLAUSIBLE.get(name, _JSON))
    if isinstance(body.get("messages"), list) and "max_tokens" not in body:
        body["max_tokens"] = draw(st.integers(1, 3))
    return path, body


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_fuzzed_bodies_never_get_a_5xx(server: ServerThread, request: tuple[str, Any]) -> None:
    path, body = request
    try:
        content = json.dumps(body, allow_nan=True).encode()
    except (ValueError, TypeError):
        return
    response = post(server, path, content)
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text


def test_server_is_still_healthy_after_everything(server: ServerThread, context: ServerContext) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    wait_until(lambda: engine_is_idle(context), timeout_s=10)
    assert context.engine.kv_cache.manager.num_used_blocks == 0
