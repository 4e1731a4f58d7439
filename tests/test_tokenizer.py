"""Tokenizer and IncrementalDetokenizer, checked against Hugging Face transformers on real tokenizers:
SmolLM2 (byte-level BPE, no BOS, chat template) and Gemma 3 (SentencePiece-style, BOS, no chat template),
plus a tiny Llama-2-style tokenizer built here (byte fallback, decoder strips the first leading space).
The real ones are transformers' conversions of the GGUF files, read from tokenmill's cache (converted once
per machine, not once per test worker: ~35 s for Gemma 3); test_gguf_tokenizer.py checks that cache against
a fresh conversion (of SmolLM2's file)."""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tokenmill.engine.stop_strings import StopStringDetokenizer
from tokenmill.errors import TokenizerError
from tokenmill.loading.gguf_tokenizer import gguf_hf_tokenizer
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Case:
    name: str
    tokenizer: Tokenizer
    hf: PreTrainedTokenizerBase
    special_text: str  # a prompt written with the tokenizer's own control tokens


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path: Path) -> Case:
    hf = gguf_hf_tokenizer(smollm2_gguf_path)
    # add_bos as the GGUF file states it (tokenizer.ggml.add_bos_token = false).
    return Case("smollm2", Tokenizer(hf, add_bos=False), hf, "<|im_start|>user\nHi there<|im_end|>\n")


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf_path: Path) -> Case:
    hf = gguf_hf_tokenizer(gemma3_gguf_path)
    return Case("gemma3", Tokenizer(hf, add_bos=True), hf, "<start_of_turn>user\nHi there<end_of_turn>\n")


def build_llama_style_hf_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's tokenizer.json layout on a tiny vocabulary: most text falls back to byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{byte:02X}>": 3 + byte for byte in range(256)}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w"), ("o", "r"), ("l", "d"), ("▁w", "or")]
    merges += [("▁wor", "ld"), ("▁", "H"), ("e", "l"), ("l", "o"), ("▁H", "el"), ("▁Hel", "lo")]
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?", *map("".join, merges)]:
        vocab.setdefault(piece, len(vocab))
    raw = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for name in ("<unk>", "<s>", "</s>")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def llama_style() -> Case:
    hf = build_llama_style_hf_tokenizer()
    return Case("llama_style", Tokenizer(hf), hf, "<s>Hello</s>")


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request: pytest.FixtureRequest) -> Case:
    case: Case = request.getfixturevalue(request.param)
    return case


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "llama_style"])
def any_case(request: pytest.FixtureRequest) -> Case:
    case: Case = request.getfixturevalue(request.param)
    return case


PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n",
    "机器学习是人工智能的一个分支。",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "  leading spaces,\ttabs\t and\n\n\nnewlines   \r\n trailing  ",
    "Mixed 中文 and English, ça va? Ünïcödé — “quotes” …",
    "",
]


# --- encode / decode against transformers ------------------------------------------------------------


@pytest.mark.parametrize("prompt", [*PROMPTS, "special"])
def test_encode_and_decode_match_transformers(real: Case, prompt: str) -> None:
    text = real.special_text if prompt == "special" else prompt
    ids = real.tokenizer.encode(text)
    assert ids == real.hf.encode(text, add_special_tokens=True)
    assert real.tokenizer.encode(text, add_special_tokens=False) == real.hf.encode(
        text, add_special_tokens=False
    )
    assert real.tokenizer.decode(ids) == real.hf.decode(ids, skip_special_tokens=True)
    assert real.tokenizer.decode(ids, skip_special_tokens=False) == real.hf.decode(ids)
    plain_ids = real.tokenizer.encode(text, add_special_tokens=False)
    assert real.tokenizer.decode(plain_ids, skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None, database=None)
@given(text=st.text(max_size=40))
def test_encode_matches_transformers_on_random_text(real: Case, text: str) -> None:
    ids = real.tokenizer.encode(text)
    assert ids == real.hf.encode(text)
    assert real.tokenizer.decode(ids) == real.hf.decode(ids, skip_special_tokens=True)


def test_decode_of_random_ids_matches_transformers(any_case: Case) -> None:
    """Any ids, specials among them (byte-fallback runs cut anywhere, unknown pieces): ``decode`` goes
    straight to the fast tokenizer's Rust decoder and must read exactly as transformers' ``decode``."""
    case, rng = any_case, random.Random(1)
    assert case.tokenizer._rust_decoder is not None  # these tokenizers take the direct path
    specials = sorted(case.hf.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(case.tokenizer.vocab_size) for _ in range(rng.randint(0, 12))]
        ids += rng.sample(specials, min(2, len(specials)))
        rng.shuffle(ids)
        for skip in (True, False):
            expected = case.hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert case.tokenizer.decode(ids, skip_special_tokens=skip) == expected, (ids, skip)


def test_special_tokens_in_text_are_single_ids(real: Case) -> None:
    ids = real.tokenizer.encode(real.special_text, add_special_tokens=False)
    tokens = real.tokenizer.convert_ids_to_tokens(ids)
    assert tokens[0] == real.special_text.split("\n")[0].removesuffix("user")
    assert ids[0] in real.tokenizer.skipped_special_ids


def test_properties_match_transformers(real: Case) -> None:
    tok, hf = real.tokenizer, real.hf
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert tok.vocab_size == len(hf)
    assert tok.all_special_ids == hf.all_special_ids
    assert tok.convert_ids_to_tokens([5, 100, 1000]) == hf.convert_ids_to_tokens([5, 100, 1000])


def test_gemma3_gets_exactly_one_bos(gemma3: Case) -> None:
    tok = gemma3.tokenizer
    bos = tok.bos_token_id
    assert bos is not None
    assert tok.encode("Hi")[:1] == [bos]
    assert tok.encode("Hi", add_special_tokens=False)[:1] != [bos]
    # transformers doubles a BOS the text already has; tokenmill does not.
    assert gemma3.hf.encode("<bos>Hi")[:2] == [bos, bos]
    assert tok.encode("<bos>Hi") == gemma3.hf.encode("<bos>Hi", add_special_tokens=False)
    assert tok.encode("<bos>Hi").count(bos) == 1


def test_smollm2_gets_no_bos(smollm2: Case) -> None:
    assert smollm2.tokenizer.encode("Hi") == smollm2.hf.encode("Hi", add_special_tokens=False)
    assert Tokenizer(smollm2.hf).encode("Hi") == smollm2.tokenizer.encode("Hi")  # add_bos=None: as HF does


def test_add_bos_overrides_the_hf_tokenizer(real: Case) -> None:
    bos = real.tokenizer.bos_token_id
    plain = real.hf.encode("Hi", add_special_tokens=False)
    assert Tokenizer(real.hf, add_bos=True).encode("Hi") == [bos, *plain]
    assert Tokenizer(real.hf, add_bos=False).encode("Hi") == plain


# --- chat templates ----------------------------------------------------------------------------------

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "What is 2+2? 你好 😀"},
    ],
    [{"role": "user", "content": "Tell me a joke."}],
]

GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
    "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm2: Case, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    text = smollm2.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = smollm2.hf.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = smollm2.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == smollm2.hf.encode(expected, add_special_tokens=False)


def test_chat_content_parts_are_flattened(smollm2: Case) -> None:
    parts = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
    flattened = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    plain = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "First part.\nSecond part."}])
    assert flattened == plain


def test_text_that_is_not_unicode_is_refused_by_name(real: Case) -> None:
    """A lone surrogate (valid in a Python string, not in Unicode) names itself and where it is, as a
    TokenizerError (the server's 400), not the Rust tokenizer's TypeError."""
    with pytest.raises(TokenizerError, match=r"lone surrogate, U\+D800 at character 3"):
        real.tokenizer.encode("abc\ud800def")


def test_a_chat_of_no_messages_or_no_unicode_is_refused_by_name(smollm2: Case) -> None:
    with pytest.raises(TokenizerError, match=r"lone surrogate, U\+DFFF"):
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "\udfff"}], tokenize=True)
    with pytest.raises(TokenizerError, match="at least one message"):
        smollm2.tokenizer.apply_chat_template([])


def test_max_token_chars_bounds_every_token_text(real: Case) -> None:
    """No token decodes to more characters than ``max_token_chars`` (the server refuses a prompt longer
    than the context times this before tokenizing it)."""
    longest = real.tokenizer.max_token_chars
    texts = real.hf.batch_decode([[token] for token in range(len(real.hf))], skip_special_tokens=False)
    assert max(map(len, texts)) <= longest


def test_chat_non_text_part_is_refused(smollm2: Case) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(TokenizerError, match="only text parts"):
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": parts}])


def test_chat_text_with_bos_is_encoded_with_one_bos(gemma3: Case) -> None:
    conversation = CONVERSATIONS[0][1:]
    tok, bos = gemma3.tokenizer, gemma3.tokenizer.bos_token_id
    text = tok.apply_chat_template(conversation, chat_template=GEMMA_STYLE_TEMPLATE)
    assert text == gemma3.hf.apply_chat_template(
        conversation, chat_template=GEMMA_STYLE_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    ids = tok.apply_chat_template(conversation, chat_template=GEMMA_STYLE_TEMPLATE, tokenize=True)
    assert ids == gemma3.hf.encode(text, add_special_tokens=False)
    assert ids[0] == bos and ids.count(bos) == 1
    assert tok.encode(text) == ids


def test_no_chat_template_is_a_clear_error(gemma3: Case) -> None:
    with pytest.raises(TokenizerError, match="no chat template"):
        gemma3.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_template_exception_is_a_tokenizer_error(smollm2: Case) -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TokenizerError, match="roles must alternate"):
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=template)


# --- from_pretrained ---------------------------------------------------------------------------------


def test_from_pretrained_loads_a_saved_folder(smollm2: Case, tmp_path: Path) -> None:
    smollm2.hf.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained(tmp_path)
    for prompt in PROMPTS:
        assert loaded.encode(prompt) == smollm2.tokenizer.encode(prompt)
    assert loaded.apply_chat_template(CONVERSATIONS[0]) == smollm2.tokenizer.apply_chat_template(
        CONVERSATIONS[0]
    )


@pytest.mark.parametrize("broken", ["truncated tokenizer.json", "empty folder"])
def test_broken_tokenizer_folder_is_a_clear_error(tmp_path: Path, broken: str) -> None:
    if broken == "truncated tokenizer.json":
        (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
        (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "voc')
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        Tokenizer.from_pretrained(tmp_path)


# --- incremental detokenizer -------------------------------------------------------------------------

EXOTIC_PIECES = ["你好", "世界", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "é", "ü"]
EXOTIC_PIECES += [" ", "  ", "\n", "\t", " the", "Hello"]
TEXTS = st.lists(st.one_of(st.characters(codec="utf-8"), st.sampled_from(EXOTIC_PIECES)), max_size=30).map(
    "".join
)
FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def stream(detokenizer: IncrementalDetokenizer, ids: Sequence[int], chunk: int) -> list[str]:
    pieces = [detokenizer.push(ids[start : start + chunk]) for start in range(0, len(ids), chunk)]
    return [*pieces, detokenizer.flush()]


def assert_streams_exactly(pieces: list[str], expected: str) -> None:
    assert "".join(pieces) == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in piece for piece in pieces), pieces


@FAST
@given(text=TEXTS, chunk=st.integers(1, 3))
def test_detokenizer_streams_text_exactly(any_case: Case, text: str, chunk: int) -> None:
    tok = any_case.tokenizer
    ids = tok.encode(text)
    pieces = stream(IncrementalDetokenizer(tok), ids, chunk)
    expected = tok.decode(ids)
    assert_streams_exactly(pieces, expected)
    if not tok.byte_fallback_ids and "\ufffd" not in expected:
        assert pieces[-1] == ""  # byte-level BPE: everything was already streamed before flush()


@FAST
@given(prompt=TEXTS, text=TEXTS, chunk=st.integers(1, 3))
def test_detokenizer_continues_a_prompt(any_case: Case, prompt: str, text: str, chunk: int) -> None:
    tok = any_case.tokenizer
    prompt_ids, output_ids = tok.encode(prompt), tok.encode(text, add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(tok, prompt_ids), output_ids, chunk)
    full, prompt_text = tok.decode(prompt_ids + output_ids), tok.decode(prompt_ids)
    assert full.startswith(prompt_text)
    assert_streams_exactly(pieces, full[len(prompt_text) :])
    if any_case.name != "llama_style":  # only its decoder treats the first token specially
        assert "".join(pieces) == tok.decode(output_ids)


@FAST
@given(data=st.data(), chunk=st.integers(1, 3), skip_special_tokens=st.booleans())
def test_detokenizer_on_random_ids(
    any_case: Case, data: st.DataObject, chunk: int, skip_special_tokens: bool
) -> None:
    tok = any_case.tokenizer
    # The tiny vocabulary is mostly byte tokens; runs longer than the held maximum (16) stream early.
    max_size = 16 if any_case.name == "llama_style" else 40
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=max_size))
    detokenizer = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = stream(detokenizer, ids, chunk)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_split_emoji_is_never_emitted_in_halves(smollm2: Case) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("Hi 😀!")
    pieces = stream(IncrementalDetokenizer(tok), ids, 1)
    assert len(ids) > 3  # the emoji's four bytes span several tokens
    assert [piece for piece in pieces if piece] == ["Hi", " 😀", "!"]


@pytest.mark.parametrize("name", ["gemma3", "llama_style"])
def test_sentencepiece_leading_spaces(name: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(name).tokenizer
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert stream(IncrementalDetokenizer(tok), ids, 1) == ["Hello", " world", ""]
    # After a prompt the first token's space is part of the text, even where decode() alone strips it.
    prompt_ids = tok.encode("the")
    assert "".join(stream(IncrementalDetokenizer(tok, prompt_ids), ids[1:], 1)) == " world"


def test_prompt_ending_in_a_long_byte_run(llama_style: Case) -> None:
    tok = llama_style.tokenizer
    prompt_ids = tok.encode("Hello ééé")  # six byte tokens: longer than the prompt context
    vocab = llama_style.hf.get_vocab()
    output_ids = [vocab["<0xC3>"], vocab["<0xBC>"], vocab["!"]]  # "ü!"
    assert set(prompt_ids[-6:] + output_ids[:2]) <= tok.byte_fallback_ids  # one run across the boundary
    pieces = stream(IncrementalDetokenizer(tok, prompt_ids), output_ids, 1)
    assert pieces == ["", "", "ü!", ""]


def test_special_tokens_kept_when_asked(smollm2: Case) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode(smollm2.special_text)
    detokenizer = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(detokenizer, ids, 1)) == smollm2.special_text


def test_detokenizer_decodes_a_bounded_window(smollm2: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode(" ".join(PROMPTS) * 10)
    window_sizes: list[int] = []
    decode = tok.decode

    def spying_decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        window_sizes.append(len(ids))
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spying_decode)
    pieces = stream(IncrementalDetokenizer(tok), ids, 1)
    monkeypatch.undo()
    assert "".join(pieces) == tok.decode(ids)
    assert len(ids) > 500 and max(window_sizes) <= 8


# --- spaces_between_special_tokens ------------------------------------------------------------------------


def build_wordpiece_hf_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style tokenizer: its WordPiece decoder puts a space between tokens, special ones included."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5, "!": 6}
    raw = RawTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens([AddedToken(name, special=True) for name in ("[UNK]", "[CLS]", "[SEP]")])
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def joined_specials_reference(hf: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """vLLM's ``spaces_between_special_tokens=False``, one token at a time: each token adds what the decoded
    text gains with it, except an added token right after another, which adds its own text alone."""
    added = {token_id: token.content for token_id, token in hf.added_tokens_decoder.items()}
    text = ""
    for index, token in enumerate(ids):
        if token in added and index > 0 and ids[index - 1] in added:
            text += added[token]
        else:
            text += hf.decode(ids[: index + 1])[len(hf.decode(ids[:index])) :]
    return text


@given(ids=st.lists(st.integers(0, 6), max_size=14), chunk=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_no_spaces_between_special_tokens_joins_them_as_vllm_does(ids: list[int], chunk: int) -> None:
    hf = build_wordpiece_hf_tokenizer()
    tok = Tokenizer(hf)
    joined = IncrementalDetokenizer(tok, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(stream(joined, ids, chunk)) == joined_specials_reference(hf, ids)
    spaced = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(spaced, ids, chunk)) == hf.decode(ids)
    assert hf.decode([3, 1, 2, 2, 4]) == "hello [CLS] [SEP] [SEP] world"
    assert joined_specials_reference(hf, [3, 1, 2, 2, 4]) == "hello [CLS][SEP][SEP] world"


def test_sampling_params_choose_the_engine_s_detokenizing() -> None:
    """``SamplingParams``' two detokenizing options reach the engine's per-sequence text."""
    hf = build_wordpiece_hf_tokenizer()
    ids = [3, 1, 2, 6]
    for spaces, expected in ((True, hf.decode(ids)), (False, joined_specials_reference(hf, ids))):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        text = StopStringDetokenizer(Tokenizer(hf), [], params)
        text.append(ids)
        text.finish()
        assert text.release(finished=True) == expected
    assert expected != hf.decode(ids)
    skipping = StopStringDetokenizer(Tokenizer(hf), [], SamplingParams(spaces_between_special_tokens=False))
    skipping.append(ids)
    skipping.finish()
    assert skipping.release(finished=True) == hf.decode(ids, skip_special_tokens=True)
