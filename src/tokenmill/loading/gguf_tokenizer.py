"""The Hugging Face tokenizer of a GGUF file, converted once per file and kept on disk.

transformers builds it from the file's metadata by parsing the whole file again with gguf-py, field by
field in Python: for Gemma 3's 262,144-entry vocabulary that is ~25 s on the 2-core CPU (SmolLM2's 49,152:
~7 s), paid at every load. The converted tokenizer is saved with ``save_pretrained`` under
``~/.cache/tokenmill/tokenizers`` (``$XDG_CACHE_HOME`` honoured), keyed by the file's resolved path, size
and modification time and by the transformers version that converted it; later loads read that folder
(~4 s / ~1 s). Encodings, decodings, special tokens and the chat template of the reloaded tokenizer equal
the converted one's (``tests/test_gguf_tokenizer.py``). Where the cache cannot be written the tokenizer is
converted as before.

transformers up to 5.17 converts a byte-level BPE (SmolLM2, Llama 3, Qwen) with sentencepiece steps wrapped
around its ByteLevel decoder. Decoded text is the same, but the grammar engines of structured outputs learn
how token strings map to bytes from the decoder's type, and took every 'Ġ' (a space) literally: masks
refused every token that starts with a space. Such a decoder is replaced by ByteLevel alone.

Whether the converted tokenizer puts a BOS before a text varies too (transformers 5.18-5.20 add none to
Gemma 3's, whose file asks for one); the file's ``tokenizer.ggml.add_bos_token`` is made to hold, so the
HF tokenizer that grammar backends read and that ``tokenmill quantize`` saves encodes as the model expects.
"""

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.loading.gguf_file import GGUFFile
from tokenmill.user_cache import tokenmill_cache_dir

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    return tokenmill_cache_dir("tokenizers")


def gguf_hf_tokenizer(path: Path) -> Any:
    """``AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)``, from the cache when this
    file was converted before."""
    from transformers import AutoTokenizer

    add_bos = GGUFFile(path).metadata.get("tokenizer.ggml.add_bos_token")
    add_bos = add_bos if isinstance(add_bos, bool) else None
    folder = _cached_folder(path)
    if folder is not None and folder.is_dir():
        try:
            cached = plain_byte_level_decoder(AutoTokenizer.from_pretrained(folder))
            return bos_as_stated(cached, add_bos)
        except Exception as exc:  # a damaged entry: converted again, and replaced
            logger.warning("cached tokenizer %s unreadable (%s); converting %s again", folder, exc, path.name)
            shutil.rmtree(folder, ignore_errors=True)
    converted = plain_byte_level_decoder(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
    tokenizer = bos_as_stated(converted, add_bos)
    if folder is not None:
        _save(tokenizer, folder)
    return tokenizer


def plain_byte_level_decoder(tokenizer: Any) -> Any:
    """``tokenizer`` with ByteLevel alone as its decoder where its pre-tokenizer is byte-level and its
    decoder a Sequence that ends in ByteLevel (changed in place; returned for chaining)."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None or backend.pre_tokenizer is None:
        return tokenizer
    decoder = json.loads(backend.decoder.__getstate__())
    steps = decoder.get("decoders") or []
    pre_tokenizer = json.loads(backend.pre_tokenizer.__getstate__())
    pre_steps = pre_tokenizer.get("pretokenizers") or [pre_tokenizer]
    byte_level_input = any(step.get("type") == "ByteLevel" for step in pre_steps)
    if (
        byte_level_input
        and decoder.get("type") == "Sequence"
        and steps
        and steps[-1].get("type") == "ByteLevel"
    ):
        backend.decoder = decoders.ByteLevel()
    return tokenizer


def bos_as_stated(tokenizer: Any, add_bos: bool | None) -> Any:
    """``tokenizer`` putting a BOS before every encoded text exactly when ``add_bos`` says so (None: as
    it does already); changed in place through transformers' ``add_bos_token``, returned for chaining."""
    bos = tokenizer.bos_token_id
    if add_bos is None or bos is None:
        return tokenizer
    adds_bos = tokenizer.encode("Hello", add_special_tokens=True)[:1] == [bos]
    if adds_bos != add_bos:
        tokenizer.add_bos_token = add_bos
    return tokenizer


def _cached_folder(path: Path) -> Path | None:
    import transformers

    try:
        resolved = path.resolve()
        stat = resolved.stat()
    except OSError:
        return None
    key = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return cache_root() / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save(tokenizer: Any, folder: Path) -> None:
    """Written to a temporary folder beside the entry, then renamed: concurrent loaders (test workers,
    tensor-parallel ranks) each install a whole entry or leave the first one in place."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    except OSError as exc:
        logger.warning("tokenizer cache %s not writable (%s)", folder.parent, exc)
        return
    try:
        tokenizer.save_pretrained(staging)
        staging.rename(folder)
    except OSError:  # another process installed the entry first, or the disk refused it
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
