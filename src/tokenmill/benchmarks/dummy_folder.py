"""Save a dummy-weight model of a real shape as an HF folder that any server can load.

Servers other than tokenmill (``transformers serve``, vLLM) need a folder: config.json, safetensors and a
tokenizer with a chat template. Without the hub there is no real tokenizer for the shape, so the folder
gets a synthetic one: a word-level vocabulary of the model's exact size, whose first entries are the
common English words that ``bench serve`` builds its prompts from (each word is one token, so a prompt
of N words is N tokens), then ``w<id>`` fillers, with the preset's BOS/EOS ids as special tokens.

    python -m tokenmill.benchmarks.dummy_folder llama-3.2-1b /tmp/llama-3.2-1b --device cuda
"""

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tokenmill.benchmarks.serve.client import WORDS
from tokenmill.loading.presets import load_preset, preset_names

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} \n{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
UNKNOWN = "[UNK]"


def synthetic_vocabulary(vocab_size: int, bos_id: int | None, eos_id: int | None) -> dict[str, int]:
    """Word -> id for every id below ``vocab_size``: prompt words first, specials at the preset's ids."""
    specials = {bos_id: "<|begin_of_text|>", eos_id: "<|end_of_text|>"}
    words = iter([UNKNOWN, *WORDS, "user", "assistant", "system", ":"])
    vocabulary = {}
    for token_id in range(vocab_size):
        word = specials.get(token_id) or next(words, None) or f"w{token_id}"
        vocabulary[word] = token_id
    return vocabulary


def save_tokenizer(folder: Path, config: dict[str, Any]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bos_id, eos_id = _first(config.get("bos_token_id")), _first(config.get("eos_token_id"))
    vocabulary = synthetic_vocabulary(config["vocab_size"], bos_id, eos_id)
    names = {token_id: word for word, token_id in vocabulary.items()}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token=UNKNOWN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    specials: dict[str, Any] = {"unk_token": UNKNOWN}
    if bos_id is not None:
        bos = names[bos_id]
        with_bos = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
        backend.post_processor = with_bos
        specials["bos_token"] = bos
    if eos_id is not None:
        specials["eos_token"] = names[eos_id]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHAT_TEMPLATE, **specials)
    tokenizer.save_pretrained(folder)


def save_weights(folder: Path, config: dict[str, Any], dtype: torch.dtype, device: str, seed: int) -> None:
    """Random weights through transformers' own initialization, saved as safetensors with config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(folder)


def _first(value: int | list[int] | None) -> int | None:
    return value[0] if isinstance(value, list) else value


def write_folder(preset: str, folder: Path, dtype: str, device: str, seed: int = 0) -> None:
    config = load_preset(preset)
    if config is None:
        raise ValueError(f"no preset named {preset!r}; presets: {', '.join(preset_names())}")
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(folder, config, getattr(torch, dtype), device, seed)
    save_tokenizer(folder, config)
    written = json.loads((folder / "config.json").read_text())
    print(f"wrote {folder}: {written['model_type']}, vocabulary {written['vocab_size']}, {dtype}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("preset", help=f"one of: {', '.join(preset_names())}")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cpu", help="where to initialize the weights (cuda is faster)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_folder(args.preset, args.folder, args.dtype, args.device, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
