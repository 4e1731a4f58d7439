"""The GGUF loader, checked three ways:

- the two real GGUF models (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) against Hugging Face transformers
  loading the same files: config, last-position logits, and greedy tokens (transformers' outputs kept
  on disk by ``hf_reference``, recomputed whenever the file, the prompts or a library version change);
- tiny random models of every architecture written as GGUF the way llama.cpp writes them, which must
  load into exactly the model the safetensors path builds;
- malformed files, which must fail with a ``ModelLoadError`` naming the file and the problem.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from engine_helpers import in_thread
from gguf_fixtures import GGUF_ARCH, save_hf_model, tiny_gguf_config, write_gguf
from hf_reference import HFReference, hf_reference
from tokenmill.config import EngineConfig
from tokenmill.engine.hardware_defaults import Platform, kernel_options_for, resolve_config
from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loading import load_model
from tokenmill.loading.default_model import default_model_path
from tokenmill.loading.gguf_checkpoint import GGUFCheckpoint
from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.loading.loader import LoadedModel
from tokenmill.models import CausalLM, ModelConfig
from tokenmill.reference import GreedyOutput, greedy_generate
from tokenmill.tokenizer import Tokenizer

# Both sides run float32 on identical weights (the default path keeps GGUF blocks packed and forms the
# same float32 weights in registers); only the summation order of matmuls and attention differs. Each
# side is itself up to ~1e-4 from a float64 run of the same model (SmolLM2, "markdown" prompt: transformers
# float32 8.5e-5, tokenmill packed 7.5e-5, tokenmill float32 weights 8.8e-5), so two float32 orders may
# differ by twice that (measured: 1.5e-4); 3e-4 allows it, while any real mistake (q/k permutation, a norm
# offset, rope base, sliding window) moves logits by 1e-2 or more.
LOGIT_TOLERANCE = 3e-4
NEW_TOKENS = 48

_LONG_ENGLISH = (
    "The printing press changed Europe in ways its inventor could hardly have imagined. Before Gutenberg "
    "built his machine in Mainz around 1440, books were copied by hand, usually by monks working in "
    "cold scriptoria, and a single Bible could take a scribe more than a year. Within fifty years of the "
    "first printed pages, presses were running in more than two hundred cities, and millions of volumes "
    "had been produced. Prices fell, literacy rose, and ideas travelled faster than any ruler could "
    "control them. Scholars could compare identical copies of a text, which made careful argument and "
    "correction possible on a scale never seen before. Merchants printed price lists and maps; "
    "reformers printed pamphlets that spread across borders in weeks. Some historians argue that the "
    "scientific revolution would have been impossible without cheap, accurate reproduction of tables, "
    "diagrams and observations. Others point out that the new technology also spread rumours, forgeries "
    "and hatred, much as new media do today. Either way, the world after the press was a different "
    "place, and the habits it created, reading silently, citing sources, owning books, shaped the "
    "centuries that followed. Printers themselves became a new kind of tradesman, part craftsman and part "
    "publisher, who had to guess what readers wanted before a single copy was sold. Many went bankrupt; "
    "a few grew rich on almanacs, grammars and devotional books that sold year after year. In the end, the "
    "most important consequence may have been"
)
SMOLLM2_TEXTS = {
    "short": "The capital of France is",
    "one word": "Hello",
    "long prose": _LONG_ENGLISH,
    "code": 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    "chinese": "人工智能的未来发展趋势是",
    "emoji": "I love pizza 🍕 and sushi 🍣, but my favourite food is",
    "arithmetic": "Question: What is 17 * 23?\nAnswer:",
    "json": '{"name": "Alice", "age": 30, "hobbies": [',
    "markdown": "## Shopping list\n\n- apples\n- ",
}
SMOLLM2_CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the boiling point of water?"},
    {"role": "assistant", "content": "100 degrees Celsius at sea level."},
    {"role": "user", "content": "And in Fahrenheit?"},
]
# Past Gemma's 512-token sliding window, so local layers must drop the start while global ones keep it.
_PAST_WINDOW = "Here is a table of squares. " + " ".join(f"{i} squared is {i * i}." for i in range(1, 58))
GEMMA3_TEXTS = {
    "short": "The capital of France is",
    "code": "def is_prime(n):\n",
    "past window": _PAST_WINDOW,
}


@dataclass
class Comparison:
    ours_logits: torch.Tensor  # last prompt position
    ours_tokens: list[int]
    reference_logits: torch.Tensor
    reference_tokens: list[int]

    @property
    def max_logit_diff(self) -> float:
        return float((self.ours_logits - self.reference_logits).abs().max())


def with_default_kernels(loaded: LoadedModel) -> CausalLM:
    """The model bound to the layer paths an engine given no flags binds on this machine (on the CPU, for
    a GGUF file: packed projections with the norm / activation formed in their C calls)."""
    config = resolve_config(EngineConfig(), Platform.detect(loaded.device), 8192, loaded.quantization)
    return loaded.model.with_kernels(kernel_options_for(config, loaded.device))


def compare_with_transformers(
    ours: LoadedModel, reference: HFReference, prompts: dict[str, list[int]]
) -> dict[str, Comparison]:
    """Our reference loop on each prompt (one sequence, greedy, stopping at our EOS ids as transformers was
    told to) through the default layer paths, beside transformers' outputs on the same GGUF file."""
    model = with_default_kernels(ours)

    def generate() -> dict[str, GreedyOutput]:
        return {
            name: greedy_generate(model, prompt, NEW_TOKENS, stop_token_ids=ours.eos_token_ids)
            for name, prompt in prompts.items()
        }

    comparisons = {}
    for name, mine in in_thread(generate).items():
        theirs = reference.outputs[name]
        comparisons[name] = Comparison(mine.prompt_logits, mine.token_ids, theirs.logits, theirs.tokens)
    return comparisons


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2: LoadedModel) -> dict[str, list[int]]:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    prompts = {name: tokenizer.encode(text) for name, text in SMOLLM2_TEXTS.items()}
    prompts["chat"] = tokenizer.apply_chat_template(SMOLLM2_CHAT, tokenize=True)
    return prompts


@pytest.fixture(scope="module")
def gemma3_prompts(gemma3: LoadedModel) -> dict[str, list[int]]:
    assert gemma3.tokenizer is not None
    return {name: gemma3.tokenizer.encode(text) for name, text in GEMMA3_TEXTS.items()}


@pytest.fixture(scope="module")
def smollm2_reference(
    smollm2: LoadedModel, smollm2_gguf_path: Path, smollm2_prompts: dict[str, list[int]]
) -> HFReference:
    """transformers' load of the file conftest's shared SmolLM2 (the default model) was loaded from."""
    return hf_reference(smollm2_gguf_path, smollm2_prompts, NEW_TOKENS, smollm2.eos_token_ids)


@pytest.fixture(scope="module")
def gemma3_reference(
    gemma3: LoadedModel, gemma3_gguf_path: Path, gemma3_prompts: dict[str, list[int]]
) -> HFReference:
    return hf_reference(gemma3_gguf_path, gemma3_prompts, NEW_TOKENS, gemma3.eos_token_ids)


@pytest.fixture(scope="module")
def smollm2_comparisons(
    smollm2: LoadedModel, smollm2_reference: HFReference, smollm2_prompts: dict[str, list[int]]
) -> dict[str, Comparison]:
    return compare_with_transformers(smollm2, smollm2_reference, smollm2_prompts)


@pytest.fixture(scope="module")
def gemma3_comparisons(
    gemma3: LoadedModel, gemma3_reference: HFReference, gemma3_prompts: dict[str, list[int]]
) -> dict[str, Comparison]:
    return compare_with_transformers(gemma3, gemma3_reference, gemma3_prompts)


def assert_matches(comparison: Comparison) -> None:
    assert comparison.max_logit_diff <= LOGIT_TOLERANCE
    assert comparison.ours_tokens == comparison.reference_tokens


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [*SMOLLM2_TEXTS, "chat"])
def test_smollm2_matches_transformers(smollm2_comparisons: dict[str, Comparison], prompt: str) -> None:
    assert_matches(smollm2_comparisons[prompt])


@pytest.mark.slow
@pytest.mark.parametrize("prompt", list(GEMMA3_TEXTS))
def test_gemma3_matches_transformers(gemma3_comparisons: dict[str, Comparison], prompt: str) -> None:
    assert_matches(gemma3_comparisons[prompt])


@pytest.mark.slow
def test_smollm2_prompts_cover_the_intended_lengths(
    smollm2: LoadedModel, smollm2_prompts: dict[str, list[int]]
) -> None:
    assert smollm2.tokenizer is not None
    assert len(smollm2_prompts["one word"]) == 1
    assert 280 <= len(smollm2_prompts["long prose"]) <= 350
    chat = smollm2.tokenizer.decode(smollm2_prompts["chat"], skip_special_tokens=False)
    assert chat.count("<|im_start|>") == 5 and chat.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_gemma3_long_prompt_exceeds_the_sliding_window(
    gemma3: LoadedModel, gemma3_prompts: dict[str, list[int]]
) -> None:
    assert {w for w in gemma3.config.sliding_windows if w} == {512}
    assert 550 <= len(gemma3_prompts["past window"]) <= 700


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_tokenizer_encodes_like_transformers(model: str, request: pytest.FixtureRequest) -> None:
    tokenizer: Tokenizer | None = request.getfixturevalue(model).tokenizer
    assert tokenizer is not None
    hf_tokenizer = tokenizer.hf_tokenizer  # AutoTokenizer.from_pretrained(dir, gguf_file=name)
    for text in [*SMOLLM2_TEXTS.values(), *GEMMA3_TEXTS.values()]:
        assert tokenizer.encode(text) == hf_tokenizer(text).input_ids


def expected_from_transformers(hf: Any) -> dict[str, Any]:
    """The ModelConfig fields transformers' GGUF config implies."""
    rope = hf.rope_parameters
    layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    return {
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_heads": hf.num_attention_heads,
        "num_kv_heads": hf.num_key_value_heads,
        "head_dim": hf.head_dim,
        "vocab_size": hf.vocab_size,
        "max_position_embeddings": hf.max_position_embeddings,
        "norm_eps": hf.rms_norm_eps,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "rope_theta": rope.get("full_attention", rope)["rope_theta"],
        "local_rope_theta": rope["sliding_attention"]["rope_theta"] if "sliding_attention" in rope else None,
        "sliding_windows": tuple(
            hf.sliding_window if t == "sliding_attention" else None for t in layer_types
        ),
        "attention_scale": (getattr(hf, "query_pre_attn_scalar", None) or hf.head_dim) ** -0.5,
        "bos_token_id": hf.bos_token_id,
        "eos_token_ids": (hf.eos_token_id,),
    }


def actual_fields(config: ModelConfig) -> dict[str, Any]:
    fields = {name: getattr(config, name) for name in dataclasses.asdict(config) if name != "raw"}
    assert config.rope is not None
    fields["rope_theta"] = config.rope.theta
    fields["local_rope_theta"] = config.local_rope.theta if config.local_rope else None
    return fields


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_config_matches_transformers(model: str, request: pytest.FixtureRequest) -> None:
    reference: HFReference = request.getfixturevalue(f"{model}_reference")
    expected = expected_from_transformers(reference.config)
    actual = actual_fields(request.getfixturevalue(model).config)
    assert {key: actual[key] for key in expected} == expected


@pytest.mark.slow
def test_smollm2_tokenizer_follows_gguf_metadata(smollm2: LoadedModel) -> None:
    metadata = GGUFFile(default_model_path()).metadata
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    assert tokenizer.hf_tokenizer.chat_template == metadata["tokenizer.chat_template"]
    assert metadata["tokenizer.ggml.add_bos_token"] is False
    assert tokenizer.encode("Hi") == tokenizer.encode("Hi", add_special_tokens=False)
    assert smollm2.eos_token_ids == (2,)


def test_weights_stream_one_tensor_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = GGUFCheckpoint(default_model_path())
    reads: list[str] = []
    original = GGUFFile.read_float32

    def counting_read(self: GGUFFile, info: Any) -> np.ndarray:
        reads.append(info.name)
        return original(self, info)

    monkeypatch.setattr(GGUFFile, "read_float32", counting_read)
    weights = checkpoint.weights()
    name, tensor = next(weights)
    assert (
        name == "model.embed_tokens.weight" and tensor.shape == (49152, 576) and tensor.dtype == torch.float32
    )
    assert reads == ["token_embd.weight"]


# Tiny models written as llama.cpp would: the GGUF path must build the model the safetensors path builds.


@pytest.mark.parametrize("name", sorted(GGUF_ARCH))
def test_tiny_gguf_loads_like_safetensors(name: str, tmp_path: Path) -> None:
    reference = save_hf_model(tiny_gguf_config(name), tmp_path / "hf")
    gguf_path = write_gguf(reference, GGUF_ARCH[name], tmp_path / f"{name}.gguf")
    from_gguf = load_model(gguf_path, dtype="float32")
    from_safetensors = load_model(tmp_path / "hf", dtype="float32")

    # GGUF stores eps as float32; GPT-2 files carry the tied head as its own tensor, as llama.cpp writes it.
    assert from_gguf.config.norm_eps == pytest.approx(from_safetensors.config.norm_eps, rel=1e-6)
    untied = {"tie_word_embeddings": from_safetensors.config.tie_word_embeddings}
    same_eps = {"norm_eps": from_safetensors.config.norm_eps}
    assert dataclasses.replace(from_gguf.config, **untied, **same_eps) == from_safetensors.config
    gguf_params = dict(from_gguf.model.named_parameters())
    for param_name, expected in from_safetensors.model.named_parameters():
        # Gemma's norms went through (w + 1) - 1 in float32, so allow rounding at 1 ulp of 1.
        torch.testing.assert_close(gguf_params[param_name], expected, atol=2e-7, rtol=0, msg=param_name)
    assert from_gguf.tokenizer is None  # the tiny files carry no vocabulary


def test_llama3_rope_freqs_must_be_reproducible(tmp_path: Path) -> None:
    config = tiny_gguf_config("llama3")
    config.rope_parameters["original_max_position_embeddings"] = 64  # not Llama 3.x's band edges
    model = save_hf_model(config, tmp_path / "hf")
    path = write_gguf(model, "llama", tmp_path / "odd-rope.gguf")
    with pytest.raises(ModelLoadError, match="rope_freqs") as error:
        load_model(path, dtype="float32")
    assert str(path) in str(error.value)


def test_yarn_rope_scaling_loads_like_safetensors(tmp_path: Path) -> None:
    """llama.cpp's yarn keys (type, factor, original context) give the config transformers' keys give."""
    config = tiny_gguf_config("qwen2")
    config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model = save_hf_model(config, tmp_path / "hf")
    path = write_gguf(model, "qwen2", tmp_path / "yarn.gguf")
    from_gguf, from_safetensors = load_model(path), load_model(tmp_path / "hf")
    assert from_gguf.config.rope == from_safetensors.config.rope
    assert from_gguf.config.max_position_embeddings == from_safetensors.config.max_position_embeddings
    prompt = list(range(3, 200, 3))  # past the original context
    gguf_logits = greedy_generate(from_gguf.model, prompt, 1).prompt_logits
    torch.testing.assert_close(gguf_logits, greedy_generate(from_safetensors.model, prompt, 1).prompt_logits)


def test_yarn_keys_without_a_transformers_meaning_are_refused(tmp_path: Path) -> None:
    config = tiny_gguf_config("qwen2")
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    model = save_hf_model(config, tmp_path / "hf")
    path = write_gguf(
        model, "qwen2", tmp_path / "yarn.gguf", extra_metadata=lambda w: w.add_rope_scaling_yarn_log_mul(0.1)
    )
    with pytest.raises(ModelLoadError, match=r"qwen2\.rope\.scaling\.yarn_log_multiplier") as error:
        load_model(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    "qtype",
    [
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q5_1,
    ],
)
def test_reader_dequantizes_storage_types(qtype: gguf.GGMLQuantizationType, tmp_path: Path) -> None:
    values = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32)
    packed = gguf.quants.quantize(values, qtype)
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    writer.add_tensor("first", np.ones(7, dtype=np.float32))  # misaligns the next tensor's start
    writer.add_tensor("packed", packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(tmp_path / "t.gguf")
    read = file.read_float32(file.tensors["packed"])
    assert read.shape == values.shape and read.dtype == np.float32
    np.testing.assert_array_equal(read, gguf.quants.dequantize(packed, qtype).reshape(values.shape))
    np.testing.assert_allclose(read, values, atol=0.25)  # within quantization error of the original
    np.testing.assert_array_equal(file.read_float32(file.tensors["first"]), np.ones(7))


# Malformed files.


def write_metadata_only(path: Path, arch: str, **fields: Callable[[gguf.GGUFWriter], None]) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for add_field in fields.values():
        add_field(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_load_fails(path: Path, *message_parts: str) -> None:
    with pytest.raises(ModelLoadError) as error:
        load_model(path, dtype="float32")
    message = str(error.value)
    for part in (str(path), *message_parts):
        assert part in message, message


def test_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist") as error:
        GGUFCheckpoint(tmp_path / "absent.gguf")
    assert str(tmp_path / "absent.gguf") in str(error.value)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "the file is empty"),
        (b"PK\x03\x04 a zip archive, not a model", "not a GGUF file"),
        (b"GGUF\x07\x00\x00\x00" + bytes(16), "GGUF version 7 is not supported"),
        (b"GGUF\x00\x00\x00\x03" + bytes(16), "big-endian"),
    ],
)
def test_not_a_gguf_file_is_reported(content: bytes, problem: str, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert_load_fails(path, problem)


def _truncation_points(file: GGUFFile, size: int) -> dict[str, int]:
    data_start = min(info.offset for info in file.tensors.values())
    return {
        "counts": 12,
        "metadata": 5000,
        "tensor directory": data_start - 100,
        "first tensor": data_start + 1000,
        "last byte": size - 1,
    }


def test_truncated_file_is_reported(tmp_path: Path) -> None:
    source = default_model_path()
    content = source.read_bytes()
    for where, cut in _truncation_points(GGUFFile(source), len(content)).items():
        path = tmp_path / f"cut-in-{where.replace(' ', '-')}.gguf"
        path.write_bytes(content[:cut])
        assert_load_fails(path, "truncated")
        path.unlink()


def test_missing_metadata_key_is_reported(tmp_path: Path) -> None:
    path = write_metadata_only(
        tmp_path / "no-block-count.gguf",
        "llama",
        width=lambda w: w.add_embedding_length(64),
        ffn=lambda w: w.add_feed_forward_length(128),
        heads=lambda w: w.add_head_count(4),
        context=lambda w: w.add_context_length(128),
        eps=lambda w: w.add_layer_norm_rms_eps(1e-5),
    )
    assert_load_fails(path, "lacks the required key 'llama.block_count'")


def test_missing_architecture_key_is_reported(tmp_path: Path) -> None:
    path = write_metadata_only(tmp_path / "no-arch.gguf", "llama")
    path.write_bytes(path.read_bytes().replace(b"general.architecture", b"general.architectur_"))
    assert_load_fails(path, "lacks the required key 'general.architecture'")


def test_unsupported_architecture_is_reported(tmp_path: Path) -> None:
    path = write_metadata_only(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(UnsupportedArchitectureError, match="'mamba' is not supported") as error:
        load_model(path)
    assert str(path) in str(error.value)
