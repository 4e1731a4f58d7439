"""vLLM's newer sampling fields offline, on the tiny Llama with a character tokenizer (every id is readable
text): ``include_stop_str_in_output`` (and the text of a stop token), ``allowed_token_ids``, ``bad_words``
and ``cache_salt``. References are computed here: texts by the Hugging Face tokenizer from the token ids,
masked greedy decoding by transformers' own forward pass of the same checkpoint, token by token."""

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from engine_helpers import engine_for, llm_for, run_to_completion
from tiny_tokenizers import text_model_fixtures
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.bad_words import bad_words_token_ids
from tokenmill.engine.stop_strings import StopStringDetokenizer
from tokenmill.loading import LoadedModel
from tokenmill.outputs import CompletionOutput
from tokenmill.sequence import Sequence as Seq
from tokenmill.speculative.verification import verification_rows

EOS = 2
PROMPT = "once upon a time"
SPECULATIVE = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}


folder, model, hf_tokenizer = text_model_fixtures("tiny-text")


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llms(model: LoadedModel) -> dict[bool, LLM]:
    """An offline LLM without and with (n-gram) speculative decoding, shared by the module's tests."""
    return {False: llm_for(model), True: llm_for(model, **SPECULATIVE)}


def generate(
    llms: dict[bool, LLM], params: SamplingParams, speculative: bool = False
) -> list[CompletionOutput]:
    return llms[speculative].generate(PROMPT, params)[0].outputs


def free_run(llms: dict[bool, LLM], **params: Any) -> list[CompletionOutput]:
    """What the request gives with nothing stopping it early."""
    return generate(llms, SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **params}))


def prompt_ids(hf_tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return list(hf_tokenizer.encode(PROMPT))


def masked_greedy(
    hf_model: PreTrainedModel, prompt: list[int], steps: int, banned: Callable[[list[int]], Sequence[int]]
) -> list[int]:
    """transformers' greedy tokens, the whole sequence recomputed each step, ``banned(output)`` masked out."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1]
            logits[list(banned(output))] = -torch.inf
            output.append(int(logits.argmax()))
    return output


# -- include_stop_str_in_output -----------------------------------------------------------------------------


def cut_at_stops(
    hf_tokenizer: PreTrainedTokenizerBase, tokens: list[int], stops: list[str], include: bool
) -> tuple[list[int], str, str]:
    """vLLM's result for ``stops`` over an uncut run's ``tokens``, from the tokenizer's text: the stop string
    that ends first (ties: the first listed), the text up to its start (or end, ``include``), and the
    tokens up to the one whose text completes it."""
    text = hf_tokenizer.decode(tokens)
    ends = [(text.find(stop) + len(stop), order, stop) for order, stop in enumerate(stops) if stop in text]
    end, _, stop = min(ends)
    kept = next(k for k in range(1, len(tokens) + 1) if len(hf_tokenizer.decode(tokens[:k])) >= end)
    return tokens[:kept], text[: end if include else end - len(stop)], stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_or_keep_the_stop_string_for_every_sample(
    llms: dict[bool, LLM], hf_tokenizer: PreTrainedTokenizerBase, include: bool
) -> None:
    """n seeded samples with logprobs: each ends at the stop string (kept with the flag), its tokens and
    logprobs those of the uncut run up to the token that completes it; the streamed pieces add up to it."""
    sampled = {"n": 3, "temperature": 1.0, "seed": 11, "logprobs": 2}
    uncut = free_run(llms, **sampled)
    stops = [uncut[0].text[9:11], uncut[1].text[5:8], uncut[2].text[12:13]]
    params = SamplingParams(
        max_tokens=24, ignore_eos=True, stop=stops, include_stop_str_in_output=include, **sampled
    )
    # RequestOutput.apply joins the streamed pieces: the text checked below is what a stream adds up to.
    outputs = run_to_completion(llms[False].engine, {"r": (prompt_ids(hf_tokenizer), params)})["r"].outputs
    for full, output in zip(uncut, outputs, strict=True):
        tokens, text, stop = cut_at_stops(hf_tokenizer, full.token_ids, stops, include)
        assert (output.token_ids, output.text, output.stop_reason) == (tokens, text, stop)
        assert output.finish_reason == "stop"
        assert output.logprobs is not None and full.logprobs is not None
        for got, want in zip(output.logprobs, full.logprobs[: len(tokens)], strict=True):
            assert got.keys() == want.keys()
            assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4) for t in got)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_under_speculative_steps(
    llms: dict[bool, LLM], hf_tokenizer: PreTrainedTokenizerBase, include: bool
) -> None:
    """Steps that keep several tokens at once end where a stop string ends, as token-by-token steps do."""
    uncut = free_run(llms, temperature=0)[0]
    text = uncut.text  # repetitive, as a tiny random model's greedy text is: n-gram guesses come true
    stops = [next(text[i : i + 3] for i in range(20, len(text)) if text.find(text[i : i + 3]) == i)]
    params = SamplingParams(temperature=0, max_tokens=24, stop=stops, include_stop_str_in_output=include)
    output = generate(llms, params, speculative=True)[0]
    tokens, text, stop = cut_at_stops(hf_tokenizer, uncut.token_ids, stops, include)
    assert (output.token_ids, output.text, output.stop_reason) == (tokens, text, stop)
    assert output.spec_decode is not None and output.spec_decode.num_accepted > 0


def test_a_stop_token_s_text_is_left_out_unless_included(
    llms: dict[bool, LLM], hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    """As vLLM: the token of ``stop_token_ids`` (or EOS) that ends the output stays in its token ids, and its
    text only with ``include_stop_str_in_output``."""
    uncut = free_run(llms, temperature=0)[0].token_ids
    stop_token = uncut[6]
    end = uncut.index(stop_token) + 1
    for include in (False, True):
        params = SamplingParams(
            temperature=0, stop_token_ids=[stop_token], include_stop_str_in_output=include
        )
        output = generate(llms, params)[0]
        assert (output.token_ids, output.stop_reason) == (uncut[:end], stop_token)
        assert output.text == hf_tokenizer.decode(uncut[: end if include else end - 1])
    forced_eos = {"temperature": 0, "logit_bias": {EOS: 100.0}, "min_tokens": 3, "skip_special_tokens": False}
    for include in (False, True):
        output = generate(llms, SamplingParams(include_stop_str_in_output=include, **forced_eos))[0]
        assert len(output.token_ids) == 4 and output.token_ids[-1] == EOS and output.finish_reason == "stop"
        shown = output.token_ids if include else output.token_ids[:-1]
        assert output.text == hf_tokenizer.decode(shown, skip_special_tokens=False)
        assert output.text.endswith("</s>") == include


def first_stop_char_by_char(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The text as it stands when, adding one character at a time, a stop string first appears (ties: the
    first listed): cut before it, or after it with ``include``."""
    for end in range(1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            return text[: end if include else end - len(ending[0])], ending[0]
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_string_that_ends_first_wins_however_tokens_arrive(
    model: LoadedModel, include: bool
) -> None:
    """Tokens pushed in random chunks (a speculative step keeps several): the text ends at the stop string
    that a character-by-character reading meets first, and the pieces released on the way add up to it."""
    tokenizer = model.tokenizer
    assert tokenizer is not None
    rng = random.Random(5)
    for _ in range(60):
        ids = [rng.randrange(3, 384) for _ in range(rng.randint(4, 16))]
        text = tokenizer.decode(ids)
        stops = [text[start : start + rng.randint(1, 4)] for start in rng.sample(range(len(text)), 2)]
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        detokenizer = StopStringDetokenizer(tokenizer, [], params)
        released, found, at = [], None, 0
        while found is None and at < len(ids):
            chunk = rng.randint(1, 4)
            found = detokenizer.append(ids[at : at + chunk])
            at += chunk
            released.append(detokenizer.release(finished=found is not None))
        if found is None:
            detokenizer.finish()
            released.append(detokenizer.release(finished=True))
        assert (detokenizer.text, found) == first_stop_char_by_char(text, stops, include)
        assert "".join(released) == detokenizer.text


def vllm_stop_by_token(
    hf_tokenizer: PreTrainedTokenizerBase, tokens: list[int], stops: list[str], min_tokens: int
) -> int:
    """How many tokens vLLM keeps, one token at a time: a stop string must end in the text of a token after
    the first ``min_tokens``."""
    for count in range(min_tokens + 1, len(tokens) + 1):
        before, text = hf_tokenizer.decode(tokens[: count - 1]), hf_tokenizer.decode(tokens[:count])
        if any(text.find(stop, max(0, len(before) - len(stop) + 1)) != -1 for stop in stops):
            return count
    return len(tokens)


def test_a_stop_string_ended_within_min_tokens_does_not_stop_later(
    llms: dict[bool, LLM], hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    """A stop string whose text ends within the first ``min_tokens`` tokens is never matched afterwards;
    one ending in the next token's text is."""
    uncut = free_run(llms, temperature=1.0, seed=3)[0].token_ids
    texts = [hf_tokenizer.decode(uncut[:count]) for count in range(len(uncut) + 1)]
    min_tokens = next(m for m in range(3, 12) if texts[m][-1] not in texts[m + 1][len(texts[m]) :])
    stops = [texts[min_tokens][-1], "\0\0\0"]  # the longer one makes the engine search further back
    expected = vllm_stop_by_token(hf_tokenizer, uncut, stops, min_tokens)
    assert expected != min_tokens + 1  # the first checked token does not end a stop string itself
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, stop=stops)
    output = generate(llms, SamplingParams(**{**vars(params), "min_tokens": min_tokens}))[0]
    assert output.token_ids == uncut[:expected]


# -- allowed_token_ids -------------------------------------------------------------------------------------


def test_allowed_token_ids_greedy_matches_a_masked_reference(
    model: LoadedModel,
    llms: dict[bool, LLM],
    hf_tokenizer: PreTrainedTokenizerBase,
    hf_model: PreTrainedModel,
) -> None:
    """Greedy under the mask equals transformers' argmax over the allowed ids, step by step; the logprobs
    are the model's own (vLLM's raw logprobs), not renormalised over the allowed ids."""
    allowed = [*range(40, 120), 7, 9]
    prompt = prompt_ids(hf_tokenizer)
    everything_else = sorted(set(range(384)) - set(allowed))
    expected = masked_greedy(hf_model, prompt, 12, lambda _: everything_else)
    params = SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed, logprobs=3)
    output = generate(llms, params)[0]
    assert output.token_ids == expected
    assert expected != free_run(llms, temperature=0, max_tokens=12)[0].token_ids[:12]  # the mask mattered
    with torch.no_grad():
        raw = torch.log_softmax(hf_model(torch.tensor([prompt + expected])).logits[0], dim=-1)
    assert output.logprobs is not None
    for position, (token, entry) in enumerate(zip(expected, output.logprobs, strict=True)):
        row = raw[len(prompt) - 1 + position]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert set(entry) - {token} == set(row.topk(3).indices.tolist()) - {token}


@pytest.mark.parametrize("speculative", [False, True])
def test_sampled_tokens_stay_within_allowed_token_ids(llms: dict[bool, LLM], speculative: bool) -> None:
    allowed = [5, 17, 64, 200, 301, 383]
    params = SamplingParams(n=4, temperature=1.5, seed=2, max_tokens=16, allowed_token_ids=allowed)
    outputs = generate(llms, params, speculative)
    assert all(set(output.token_ids) <= set(allowed) for output in outputs)
    assert len({tuple(output.token_ids) for output in outputs}) > 1


def test_allowed_token_ids_and_a_grammar_both_hold(
    llms: dict[bool, LLM], hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    """With structured outputs both masks apply: of a grammar's choices, the one the allowed ids can spell
    is written, whichever the grammar alone would pick."""
    choices = ["hello there", "cat dog"]
    constraint = StructuredOutputsParams(choice=choices)
    texts = set()
    for choice in choices:
        allowed = sorted({*hf_tokenizer.encode(choice, add_special_tokens=False), EOS})
        params = SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=constraint, allowed_token_ids=allowed
        )
        output = generate(llms, params)[0]
        assert (output.text, output.finish_reason) == (choice, "stop") and set(output.token_ids) <= set(
            allowed
        )
        texts.add(output.text)
    assert texts == set(choices)


def test_eos_passes_allowed_token_ids_only_when_listed(llms: dict[bool, LLM]) -> None:
    """vLLM adds nothing to ``allowed_token_ids``: with EOS pushed up by logit bias, a request whose list
    leaves EOS out runs to ``max_tokens``; listing it ends the request on it."""
    pushed = {"temperature": 0, "max_tokens": 8, "logit_bias": {EOS: 50.0}}
    without = generate(llms, SamplingParams(allowed_token_ids=[10, 11, 12], **pushed))[0]
    assert without.finish_reason == "length" and len(without.token_ids) == 8 and EOS not in without.token_ids
    with_eos = generate(llms, SamplingParams(allowed_token_ids=[10, 11, 12, EOS], **pushed))[0]
    assert (with_eos.token_ids, with_eos.finish_reason) == ([EOS], "stop")


def test_bad_allowed_token_ids_are_refused_by_name(model: LoadedModel) -> None:
    engine = engine_for(model)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"allowed_token_ids": [3, 384]}, r"allowed_token_ids holds token id 384, outside the vocabulary"),
        ({"allowed_token_ids": [EOS], "min_tokens": 2}, "allowed_token_ids leaves no token to sample"),
        ({"allowed_token_ids": [3, 4], "bad_words": ["a", "b"]}, "allowed_token_ids leaves no token"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", PROMPT, SamplingParams(**fields))
    for bad in ([], [-1], "12", [1.5]):
        with pytest.raises(ValueError, match=r"^allowed_token_ids must be"):
            SamplingParams(allowed_token_ids=bad)  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()


# -- bad_words ---------------------------------------------------------------------------------------------


def vllm_bad_word_ids(hf_tokenizer: PreTrainedTokenizerBase, words: list[str]) -> list[list[int]]:
    """vLLM's sequences for ``words``: each word bare, and after a space where that is as many tokens and
    starts with another one."""
    found = []
    for word in words:
        bare = hf_tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = hf_tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        found.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            found.append(spaced)
    return found


def completing(words: list[list[int]], output: list[int]) -> list[int]:
    return [
        w[-1] for w in words if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1 :] == w[:-1]
    ]


@pytest.mark.parametrize("speculative", [False, True])
def test_bad_words_greedy_matches_a_reference_that_bans_them(
    llms: dict[bool, LLM], hf_tokenizer: PreTrainedTokenizerBase, hf_model: PreTrainedModel, speculative: bool
) -> None:
    """Words picked from the free run's own text (one of them several tokens long, one written with a
    leading space): the output equals transformers' greedy run with vLLM's ban applied at each step."""
    uncut = free_run(llms, temperature=0)[0]
    text = uncut.text
    words = [text[2:5], " " + text[8:10].strip(), hf_tokenizer.decode(uncut.token_ids[4:5])]
    sequences = vllm_bad_word_ids(hf_tokenizer, words)
    assert any(len(sequence) > 1 for sequence in sequences)
    expected = masked_greedy(hf_model, prompt_ids(hf_tokenizer), 24, lambda out: completing(sequences, out))
    assert expected != uncut.token_ids
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
    output = generate(llms, params, speculative)[0]
    assert output.token_ids == expected


def test_each_verified_position_bans_what_its_own_output_would_complete() -> None:
    """A speculative step's rows: row i is sampled as if the first i draft tokens were output already, so
    its bad-word bans follow them (and ``min_tokens``' EOS ban counts them too)."""
    words = ((5, 6), (9,))
    params = SamplingParams(min_tokens=3, bad_words=["unused: the ids are given"])
    seq = Seq("s", [1, 2], params, max_tokens=10, eos_token_ids=frozenset({EOS}), bad_words=words)
    for token in (7, 5):
        seq.append_token(token)
    seq.draft_token_ids = [6, 5, 4]
    seq.attach_drafts(3)
    rows = verification_rows(seq, 3)
    outputs = [[7, 5], [7, 5, 6], [7, 5, 6, 5], [7, 5, 6, 5, 4]]
    expected = [
        completing([list(w) for w in words], out) + ([EOS] if len(out) < 3 else []) for out in outputs
    ]
    assert [sorted(row.banned_token_ids) for row in rows] == [sorted(ids) for ids in expected]
    assert [list(row.output_token_ids) for row in rows] == outputs


def test_bad_words_that_encode_to_nothing_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^bad_words must be"):
        SamplingParams(bad_words=["ok", "  "])
    with pytest.raises(ValueError, match=r"^bad_words must be"):
        SamplingParams(bad_words="word")  # type: ignore[arg-type]

    class DropsAccents:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(char) for char in text if char != "\u0301"]

    assert bad_words_token_ids(["ab"], DropsAccents()) == ((97, 98),)  # " ab" is 3 tokens: not banned

    class SpaceJoinsNextCharacter:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return (
                [1000 + ord(text[1]), *map(ord, text[2:])] if text.startswith(" ") else list(map(ord, text))
            )

    spaced = bad_words_token_ids(["  ab", "b"], SpaceJoinsNextCharacter())  # leading spaces are dropped
    assert spaced == ((97, 98), (1097, 98), (98,), (1098,))
    with pytest.raises(ValueError, match="bad_words entry '\u0301' encodes to no token"):
        bad_words_token_ids(["\u0301"], DropsAccents())


# -- cache_salt --------------------------------------------------------------------------------------------


def test_cache_salt_separates_prefix_cache_entries(
    model: LoadedModel, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    """Prompt blocks are reused only by a request of the same salt (or, unsalted, by unsalted ones), and the
    tokens are the same whichever blocks served the prompt."""
    llm = llm_for(model, kv_cache="paged", block_size=4, prefix_caching=True)
    prompt = PROMPT + " there lived a tiny model"
    params = SamplingParams(temperature=0, max_tokens=6)
    order = [("a", "a"), ("a", "a again"), ("b", "b"), (None, "none"), ("b", "b again"), (None, "none again")]
    cached, tokens = {}, set()
    for salt, name in order:
        request: dict[str, Any] = (
            {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
        )
        output = llm.generate(request, params)[0]
        cached[name] = output.num_cached_tokens
        tokens.add(tuple(output.outputs[0].token_ids))
    whole_blocks = (len(hf_tokenizer.encode(prompt)) - 1) // 4 * 4
    assert cached == {
        "a": 0,
        "b": 0,
        "none": 0,
        "a again": whole_blocks,
        "b again": whole_blocks,
        "none again": whole_blocks,
    }
    assert len(tokens) == 1
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": prompt, "cache_salt": ""}, params)
