"""Speculative decoding on the real SmolLM2 (and Gemma 3): the same greedy text, tokens, logprobs and
finish reasons with and without it (n-gram prompt lookup, and SmolLM2 drafting for itself), with stop
strings, penalties and a batch of chat prompts that copy from their prompt."""

from typing import Any

from engine_helpers import engine_for, in_thread
from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.llm import LLM
from tokenmill.outputs import RequestOutput

CODE = """def area(width, height):
    result = width * height
    return result

def perimeter(width, height):
    return 2 * (width + height)
"""
CHATS = [
    [{"role": "user", "content": f"Rename the function area to rectangle_area:\n{CODE}"}],
    [{"role": "user", "content": f"Add type hints to this code:\n{CODE}"}],
    [{"role": "user", "content": "Fix the typos: 'The quick brwn fox jumsp over the lazy dgo.'"}],
    [{"role": "user", "content": "Tell me a fact about the moon."}],
]


def chat(llm: LLM, params: list[SamplingParams]) -> list[RequestOutput]:
    return in_thread(lambda: llm.chat(CHATS, params))


def spec_llm(smollm2: Any, method: str) -> LLM:
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec = {**spec, "model": "smollm2"}
    config = EngineConfig(device="cpu").with_options(
        speculative_config=spec, cpu_kv_cache_gib=0.25, max_num_seqs=4, max_model_len=1024
    )
    return LLM(engine=LLMEngine(config, loaded=smollm2, draft=smollm2 if method == "draft_model" else None))


def test_greedy_smollm2_outputs_are_identical_with_and_without_speculation(smollm2) -> None:  # type: ignore[no-untyped-def]
    params = [
        SamplingParams(temperature=0, max_tokens=60, logprobs=2),
        SamplingParams(temperature=0, max_tokens=60, repetition_penalty=1.1, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=60, stop=["dog", "fox"]),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=5),
    ]
    plain = chat(LLM(engine=engine_for(smollm2, max_num_seqs=4, max_model_len=1024)), params)
    assert plain[2].outputs[0].stop_reason in ("dog", "fox")  # a stop string ends one of them
    for method in ("ngram", "draft_model"):
        llm = spec_llm(smollm2, method)
        outs = chat(llm, params)
        for ours, theirs in zip(outs, plain, strict=True):
            mine, ref = ours.outputs[0], theirs.outputs[0]
            assert (mine.text, mine.token_ids, mine.finish_reason, mine.stop_reason) == (
                ref.text,
                ref.token_ids,
                ref.finish_reason,
                ref.stop_reason,
            ), method
            if ref.logprobs is not None:
                assert mine.logprobs is not None
                for a, b in zip(mine.logprobs, ref.logprobs, strict=True):  # {token id: Logprob}
                    assert list(a) == list(b)
                    for token, entry in a.items():
                        assert entry.rank == b[token].rank and abs(entry.logprob - b[token].logprob) < 1e-4
        stats = llm.scheduler_stats().spec_decode
        assert stats.num_accepted > 0
        assert stats.num_emitted > stats.num_steps  # more than one token per verification step
        if method == "draft_model":
            assert stats.num_accepted == stats.num_proposed


def test_greedy_gemma3_outputs_are_identical_with_and_without_ngram_speculation(gemma3) -> None:  # type: ignore[no-untyped-def]
    prompt = "Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples,"
    params = SamplingParams(temperature=0, max_tokens=40)
    outputs = []
    for options in ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}):
        llm = LLM(engine=engine_for(gemma3, max_num_seqs=1, max_model_len=512, **options))
        outputs.append(in_thread(lambda llm=llm: llm.generate(prompt, params))[0].outputs[0])
    assert outputs[0].token_ids == outputs[1].token_ids
    assert outputs[0].text == outputs[1].text
    assert llm.scheduler_stats().spec_decode.num_accepted > 0


def test_the_server_speculates_and_counts_it_in_metrics(smollm2) -> None:  # type: ignore[no-untyped-def]
    import httpx
    import openai

    from tokenmill.server import ServerSettings, ServerThread, create_app

    engine = engine_for(
        smollm2,
        max_model_len=1024,
        max_num_seqs=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    plain = LLM(engine=engine_for(smollm2, max_model_len=1024, max_num_seqs=2))
    expected = chat(plain, [SamplingParams(temperature=0, max_tokens=40)] * len(CHATS))[0].outputs[0].text
    with ServerThread(create_app(engine, ServerSettings(served_model_name="spec"))) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="spec", messages=CHATS[0], temperature=0, max_tokens=40)  # type: ignore[arg-type]
        assert reply.choices[0].message.content == expected
        text = httpx.get(f"{server.base_url}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] != "#"}
    drafted = values["tokenmill:spec_decode_num_draft_tokens_total"]
    accepted = values["tokenmill:spec_decode_num_accepted_tokens_total"]
    steps, emitted = (
        values["tokenmill:spec_decode_num_drafts_total"],
        values["tokenmill:spec_decode_num_emitted_tokens_total"],
    )
    assert 0 < accepted <= drafted and steps <= emitted <= steps + accepted
