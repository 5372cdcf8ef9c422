"""Tokenizers for the tiny model, built locally: character-level, or BPE trained on the task's text.

Both are `transformers.Qwen2Tokenizer` objects (byte-level BPE, Qwen2's pre-tokenizer, NFC
normalizer and byte-level decoder), the tokenizer class `AutoTokenizer` picks for the tiny
model's Qwen2 architecture: a checkpoint folder (`model.save_pretrained` +
`tokenizer.save_pretrained`) loads back with `AutoTokenizer.from_pretrained(folder)` as the very
same tokenizer (same class, vocabulary, merges, special tokens, padding side and chat template),
with no `trust_remote_code`. (transformers 5 ignores a `tokenizer_class` other than
`Qwen2Tokenizer` in a folder whose model is a Qwen2: a generic fast tokenizer saved next to a
Qwen2 model would come back as a `Qwen2Tokenizer` rebuilt from its vocabulary, with other
pre-tokenization.) Both share these conventions, so everything downstream treats them alike:

* special tokens `<|pad|>` (id 0), `<|endoftext|>` (1, EOS), `<|im_start|>` (2, BOS), `<|unk|>`
  (3) and `<|im_end|>` (4), in that order, first in the vocabulary;
* a Qwen-style chat template (`<|im_start|>role\\n...<|im_end|>\\n`), left padding;
* `decode(encode(text)) == text` for any text made of `DEFAULT_CHARSET` characters. The
  vocabulary holds the byte-level symbols of those characters only (as in Qwen2, a space is
  `Ġ` and a newline `Ċ` in the vocabulary), so a character outside it is dropped when encoding,
  as by any byte-level BPE whose vocabulary lacks its bytes.

`build_tokenizer()` is the character-level one: one token per character of `DEFAULT_CHARSET`
(no merges).

`build_bpe_tokenizer(texts)` trains a byte-pair-encoding vocabulary with the `tokenizers`
library's `BpeTrainer` on `texts` (a run passes the task's own training text, see
`Task.text_corpus`) plus the chat template's role headers, pre-tokenized exactly as
`Qwen2Tokenizer` pre-tokenizes. Digits are always single tokens (as in Qwen and Llama
tokenizers), so numbers read digit by digit exactly as with the character-level tokenizer, while
words and the hint template's phrases become one token each: a channel-2 hinted context is about
3x shorter. Training is deterministic (the same texts and settings give the same vocabulary and
merges, in any process) and takes milliseconds; the result is cached on disk under
`<cache_dir>/bpe-<key>/` where `key` is a SHA-256 of everything that decides it (texts, vocabulary
size, minimum frequency, character set, special tokens, the `tokenizers` and `transformers`
versions). A cached file is used only if its recorded key and content checksum match and its
special tokens sit at the expected ids; anything else is rebuilt (with a warning) and rewritten
atomically. The cache folder is `$COMPOSER_REPLICATION_CACHE/tokenizers`, else
`$XDG_CACHE_HOME` or `~/.cache` + `/composer-replication/tokenizers`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import string
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import Qwen2Tokenizer

__all__ = [
    "BPE_VOCAB_SIZE",
    "CACHE_ENV",
    "CHAT_TEMPLATE",
    "DEFAULT_CHARSET",
    "IM_END",
    "SPECIAL_TOKENS",
    "TOKENIZER_KINDS",
    "build_bpe_tokenizer",
    "build_tokenizer",
    "default_cache_dir",
]

logger = logging.getLogger(__name__)

DEFAULT_CHARSET: str = string.ascii_letters + string.digits + string.punctuation + " \n"

SPECIAL_TOKENS: dict[str, str] = {
    "pad_token": "<|pad|>",
    "eos_token": "<|endoftext|>",
    "bos_token": "<|im_start|>",
    "unk_token": "<|unk|>",
}
IM_END = "<|im_end|>"
_SPECIALS: tuple[str, ...] = (*SPECIAL_TOKENS.values(), IM_END)

# Qwen2.5's template shape (role headers, <|im_end|> after each turn) so prompts built for the tiny
# model look like the ones a real Qwen model sees.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_ROLE_HEADERS = ("system\n", "user\n", "assistant\n")

TOKENIZER_KINDS: tuple[str, ...] = ("char", "bpe")
BPE_VOCAB_SIZE = 512
BPE_MIN_FREQUENCY = 2
CACHE_ENV = "COMPOSER_REPLICATION_CACHE"
# 2: byte-level vocabularies trained with Qwen2Tokenizer's pre-tokenizer (1: a character split).
_CACHE_FORMAT = 2


def _require_transformers() -> tuple[ModuleType, ModuleType]:
    try:
        import tokenizers
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "The tiny model's tokenizers need transformers and tokenizers; "
            "install them with `pip install composer-replication[train]`."
        ) from exc
    return transformers, tokenizers


def _wrap(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Qwen2Tokenizer:
    """The `Qwen2Tokenizer` over `vocab` and `merges` (ids 0-4 are the special tokens): exactly
    what `AutoTokenizer.from_pretrained` rebuilds from a folder it was saved to."""
    transformers, _ = _require_transformers()
    tok = transformers.Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=list(merges),
        padding_side="left",
        extra_special_tokens=[IM_END],
        clean_up_tokenization_spaces=False,
        **SPECIAL_TOKENS,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _byte_symbols(text: str) -> list[str]:
    """`text`'s characters as byte-level symbols, one per UTF-8 byte (`' '` -> `'Ġ'`), by the
    same `ByteLevel` pre-tokenizer `Qwen2Tokenizer` applies."""
    _, tokenizers = _require_transformers()
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [sym for piece, _ in byte_level.pre_tokenize_str(text) for sym in piece]


def _vocab_and_merges(backend: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary and merges of a `tokenizers.Tokenizer` (from its JSON form)."""
    model = json.loads(backend.to_str())["model"]
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ValueError("not a BPE tokenizer")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    if any(len(m) != 2 for m in merges):
        raise ValueError("a merge is not a pair of tokens")
    return dict(model["vocab"]), [(a, b) for a, b in merges]


def build_tokenizer(charset: str = DEFAULT_CHARSET) -> Qwen2Tokenizer:
    """Return a character-level `Qwen2Tokenizer` with left padding and a chat template.

    Token ids: the four special tokens and `<|im_end|>` first (ids 0-4), then one id per character
    of `charset` in order (its byte-level symbol; no merges). Characters outside `charset` are
    dropped when encoding. `charset` holds ASCII characters (one byte each), each once.
    """
    if len(set(charset)) != len(charset):
        raise ValueError("charset has repeated characters; each character must appear once")
    wide = [c for c in charset if len(c.encode("utf-8")) != 1]
    if wide:
        raise ValueError(
            f"charset characters must be ASCII (one byte each, one token each); got {wide[:5]!r}"
        )
    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for symbol in _byte_symbols(charset):
        vocab[symbol] = len(vocab)
    return _wrap(vocab, [])


def default_cache_dir() -> Path:
    """Where trained tokenizers are cached (see the module docstring)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root) / "tokenizers"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "composer-replication" / "tokenizers"


def _bpe_key(texts: list[str], vocab_size: int, min_frequency: int) -> str:
    transformers, tokenizers = _require_transformers()
    h = hashlib.sha256()
    settings = {
        "format": _CACHE_FORMAT,
        "vocab_size": vocab_size,
        "min_frequency": min_frequency,
        "charset": DEFAULT_CHARSET,
        "specials": list(_SPECIALS),
        "roles": list(_ROLE_HEADERS),
        # The pre-tokenizer is Qwen2Tokenizer's: it comes with transformers.
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
    }
    h.update(json.dumps(settings, sort_keys=True).encode("utf-8"))
    for text in texts:
        # Length-prefixed, so ["ab", "c"] and ["a", "bc"] hash differently.
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _train_bpe(texts: list[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    """A trained backend: the BPE model learnt on the pipeline of an empty `Qwen2Tokenizer`
    (its normalizer and pre-tokenizer), so the merges are the ones it will apply."""
    _, tokenizers = _require_transformers()
    from tokenizers import trainers

    backend = _wrap({tok: i for i, tok in enumerate(_SPECIALS)}, []).backend_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(_SPECIALS),
        initial_alphabet=_byte_symbols(DEFAULT_CHARSET),
        show_progress=False,
    )
    # Role headers are text the chat template adds around every turn: frequent enough to merge.
    headers = [h for h in _ROLE_HEADERS for _ in range(min_frequency)]
    backend.train_from_iterator([*headers, *texts], trainer=trainer)
    return backend


def _check_backend(backend: Tokenizer) -> str | None:
    """None if the special tokens sit at ids 0-4 and every charset character is known."""
    for i, special in enumerate(_SPECIALS):
        if backend.token_to_id(special) != i:
            return f"special token {special!r} is not at id {i}"
    unknown = [c for c in DEFAULT_CHARSET if backend.token_to_id(_byte_symbols(c)[0]) is None]
    if unknown:
        return f"characters {''.join(unknown)!r} are missing from the vocabulary"
    try:
        _vocab_and_merges(backend)
    except (ValueError, KeyError, TypeError) as exc:
        return str(exc)
    return None


def _load_cached(folder: Path, key: str) -> Tokenizer | None:
    """The cached backend in `folder` if it is valid for `key`, else None (warning if damaged)."""
    meta_path, tok_path = folder / "meta.json", folder / "tokenizer.json"
    if not meta_path.exists() and not tok_path.exists():
        return None
    _, tokenizers = _require_transformers()
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        text = tok_path.read_text(encoding="utf-8")
        if not isinstance(meta, dict) or meta.get("key") != key:
            raise ValueError("its recorded key does not match")
        if meta.get("sha256") != hashlib.sha256(text.encode("utf-8")).hexdigest():
            raise ValueError("tokenizer.json does not match its recorded checksum")
        backend = tokenizers.Tokenizer.from_str(text)
        problem = _check_backend(backend)
        if problem:
            raise ValueError(problem)
    except Exception as exc:  # tokenizers raises plain Exception on malformed JSON
        logger.warning("tokenizer cache %s is unusable (%s); rebuilding it", folder, exc)
        return None
    return backend


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _store(folder: Path, key: str, backend: Tokenizer) -> None:
    text = backend.to_str()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # tokenizer.json first: a reader that sees the new meta.json also sees its file.
        _write_atomic(folder / "tokenizer.json", text)
        meta = {"key": key, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
        _write_atomic(folder / "meta.json", json.dumps(meta, sort_keys=True))
    except OSError as exc:  # a read-only cache is not an error: the tokenizer is in memory
        logger.warning(
            "cannot write the tokenizer cache %s (%s); continuing without it", folder, exc
        )


def build_bpe_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int = BPE_VOCAB_SIZE,
    min_frequency: int = BPE_MIN_FREQUENCY,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
) -> Qwen2Tokenizer:
    """A BPE `Qwen2Tokenizer` trained on `texts` (see the module docstring).

    Args:
        texts: the training text, in a fixed order (order is part of the cache key).
        vocab_size: the largest vocabulary (specials and every `DEFAULT_CHARSET` character
            included); a small text may give fewer merges, hence a smaller vocabulary.
        min_frequency: a pair must occur this often to be merged.
        cache_dir: cache folder (default: `default_cache_dir()`).
        use_cache: False trains every time and touches no file.
    """
    texts = [str(t) for t in texts]
    if not texts:
        raise ValueError("build_bpe_tokenizer needs training text; got an empty corpus")
    floor = len(_SPECIALS) + len(DEFAULT_CHARSET)
    if not isinstance(vocab_size, int) or vocab_size < floor:
        raise ValueError(
            f"vocab_size must be an int >= {floor} (the special tokens plus one token per "
            f"character of DEFAULT_CHARSET), got {vocab_size!r}"
        )
    if not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"min_frequency must be an int >= 1, got {min_frequency!r}")
    key = _bpe_key(texts, vocab_size, min_frequency)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = folder / f"bpe-{key[:24]}"
    backend = _load_cached(folder, key) if use_cache else None
    if backend is None:
        backend = _train_bpe(texts, vocab_size, min_frequency)
        problem = _check_backend(backend)
        if problem:  # pragma: no cover - the trainer's contract; guards a library change
            raise RuntimeError(f"the BPE trainer produced an unusable vocabulary: {problem}")
        if use_cache:
            _store(folder, key, backend)
    return _wrap(*_vocab_and_merges(backend))
