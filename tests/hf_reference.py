"""Hugging Face transformers' own load of a GGUF file (it dequantizes the file itself, independently of
tokenmill's reader): its config, and for each prompt its last-prompt-position logits and greedy tokens.

Loading a real model through transformers' GGUF path and generating with it takes about a minute per
model on 2 cores, so the outputs are kept on disk (``~/.cache/tokenmill/test-references``, or the folder
``$TOKENMILL_TEST_REFERENCE_CACHE`` names; ``off`` recomputes every time and writes nothing). An entry is
used only when its key matches in full: the file's sha256, the prompts' token ids, the token count, the
stop ids, and the versions of transformers, gguf-py, numpy and torch, which do the computing. Anything
else changed recomputes it, through transformers again.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from engine_helpers import in_thread

CACHE_ENV = "TOKENMILL_TEST_REFERENCE_CACHE"
# Bump when what is computed changes (the generate() call below, what is stored): old entries then miss.
FORMAT = 1


@dataclass
class HFOutput:
    logits: torch.Tensor  # float32, at the last prompt position
    tokens: list[int]  # greedy, stopping at a stop id (included) or after the token count


@dataclass
class HFReference:
    config: PretrainedConfig
    outputs: dict[str, HFOutput]  # by prompt name


def hf_reference(
    path: Path, prompts: dict[str, list[int]], new_tokens: int, eos_token_ids: tuple[int, ...]
) -> HFReference:
    """transformers' outputs for ``prompts`` on the GGUF file ``path``: from the cache where an entry of the
    same key is there, else computed (and stored)."""
    key = _as_json(
        {
            "format": FORMAT,
            "gguf_sha256": _sha256(path),
            "prompts": prompts,
            "new_tokens": new_tokens,
            "eos_token_ids": list(eos_token_ids),
            "versions": {name: version(name) for name in ("transformers", "gguf", "numpy", "torch")},
        }
    )
    entry = _entry_path(path, key)
    stored = _read(entry)
    if stored is not None and stored["key"] == key:
        return _unpack(stored)
    reference = in_thread(lambda: _compute(path, prompts, new_tokens, eos_token_ids))
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        torch.save(_pack(key, reference), partial)
        partial.replace(entry)  # atomic: a concurrent run reads the old entry or the new, never half of one
    return reference


@torch.inference_mode()
def _compute(
    path: Path, prompts: dict[str, list[int]], new_tokens: int, eos_token_ids: tuple[int, ...]
) -> HFReference:
    """One prompt at a time: a left-padded batch is no faster on CPU and adds padding to the numerics."""
    model: Any = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    eos = list(eos_token_ids)
    outputs = {}
    for name, prompt in prompts.items():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            return_dict_in_generate=True,
            output_logits=True,
        )
        outputs[name] = HFOutput(out.logits[0][0].clone(), out.sequences[0, len(prompt) :].tolist())
    return HFReference(model.config, outputs)


def _pack(key: dict[str, Any], reference: HFReference) -> dict[str, Any]:
    return {
        "key": key,
        "config": reference.config.to_json_string(use_diff=False),
        "outputs": {name: {"logits": o.logits, "tokens": o.tokens} for name, o in reference.outputs.items()},
    }


def _read(entry: Path | None) -> dict[str, Any] | None:
    if entry is None or not entry.exists():
        return None
    try:
        stored: dict[str, Any] = torch.load(entry, weights_only=True)
    except Exception:  # an unreadable entry (a full disk, say) is recomputed and overwritten
        return None
    return stored


def _unpack(stored: dict[str, Any]) -> HFReference:
    config = AutoConfig.for_model(**json.loads(stored["config"]))
    outputs = {name: HFOutput(o["logits"], o["tokens"]) for name, o in stored["outputs"].items()}
    return HFReference(config, outputs)


def _entry_path(path: Path, key: dict[str, Any]) -> Path | None:
    folder = os.environ.get(CACHE_ENV, "")
    if folder.lower() == "off":
        return None
    base = Path(folder) if folder else Path.home() / ".cache" / "tokenmill" / "test-references"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return base / f"{path.stem}-{digest}.pt"


def _as_json(key: dict[str, Any]) -> dict[str, Any]:
    """Plain JSON values (tuples as lists), so a stored key compares equal to a rebuilt one."""
    return json.loads(json.dumps(key))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
