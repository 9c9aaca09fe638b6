"""A model folder's tokenizer as Hugging Face ships it: text <-> ids, special tokens, chat template.

`Tokenizer` loads ``tokenizer.json`` with the Rust ``tokenizers`` library and applies the JSON
configs on top as transformers' ``TokenizersBackend`` does (named and extra special tokens
registered as special; the post-processor alone decides a completion prompt's specials). An
OPT-style ``vocab.json`` + ``merges.txt`` folder is read as GPT-2 byte-level BPE, its
post-processor built from ``add_bos_token``/``add_eos_token``. Not ``AutoTokenizer``: it imports
torch, which the CPU-only ingress never loads (docs/design.md); no ``clean_up_tokenization_spaces``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _RustTokenizer

from fastserve.chat_template import DEFAULT_CHAT_OPTIONS, OPT_FALLBACK, ChatOptions, ChatTemplate

__all__ = [
    "DEFAULT_TOKENIZER_DIR",
    "Tokenizer",
    "TokenizerLoadError",
    "load_tokenizer",
]

# Resolved from this file, not the working directory: Serve replicas and tests start anywhere.
_REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER_DIR = _REPO_ROOT / "config" / "tokenizers" / "opt"

TOKENIZER_FILE = "tokenizer.json"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: A ``chat_template`` list's entry used when no name is asked (transformers' rule).
DEFAULT_TEMPLATE_NAME = "default"
_UTF8 = "utf-8"
_BYTE_VALUES = 256

#: transformers' ``SPECIAL_TOKENS_ATTRIBUTES``: the named special tokens, passed to chat templates.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
#: Further special tokens: transformers v5's name, then v4's.
EXTRA_SPECIAL_KEYS = ("extra_special_tokens", "additional_special_tokens")

_UTF8 = "utf-8"


class TokenizerLoadError(ValueError):
    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot load the tokenizer at {path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class _Settings:
    named: dict[str, AddedToken]
    extra: tuple[AddedToken, ...]
    add_bos: bool | None                  # None: the config does not say
    add_eos: bool | None
    add_prefix_space: bool
    chat_template: str | None


def _added_token(value: Any, where: Path) -> AddedToken:
    """A special token from a config: a string, or a dict with ``content`` and its flags."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized")
                 if k in value}
        return AddedToken(value["content"], special=True, **flags)
    raise TokenizerLoadError(where, f"special token {value!r} is neither a string nor "
                                    "a {'content': ...} object")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding=_UTF8))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(path, f"unreadable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise TokenizerLoadError(path, f"expected a JSON object, got {type(raw).__name__}")
    return raw


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding=_UTF8)
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        chosen = named.get(DEFAULT_TEMPLATE_NAME)
        if isinstance(chosen, str):
            return chosen
        raise TokenizerLoadError(directory / TOKENIZER_CONFIG_FILE,
                                 f"chat_template lists {sorted(map(str, named))} but no "
                                 f"{DEFAULT_TEMPLATE_NAME!r} template")
    raise TokenizerLoadError(directory / TOKENIZER_CONFIG_FILE,
                             f"chat_template is a {type(template).__name__}, not a string")


def _read_settings(directory: Path) -> _Settings:
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    specials_path = directory / SPECIAL_TOKENS_FILE
    # transformers merges special_tokens_map.json under tokenizer_config.json's own values.
    merged = {**(_read_json(specials_path) if specials_path.is_file() else {}),
              **{k: v for k, v in config.items() if v is not None}}
    named = {k: _added_token(merged[k], config_path) for k in NAMED_SPECIAL_TOKENS
             if merged.get(k) is not None}
    extra: list[AddedToken] = []
    for key in EXTRA_SPECIAL_KEYS:
        values = merged.get(key) or []
        if isinstance(values, Mapping):   # v5 may name them
            values = list(values.values())
        extra += [_added_token(v, config_path) for v in values]
    def flag(key: str) -> bool | None:
        return bool(config[key]) if config.get(key) is not None else None

    return _Settings(named, tuple(extra), flag("add_bos_token"), flag("add_eos_token"),
                     bool(config.get("add_prefix_space", False)), _chat_template(directory, config))


def _byte_level_bpe(directory: Path, add_prefix_space: bool) -> _RustTokenizer:
    rust = _RustTokenizer(models.BPE.from_file(str(directory / VOCAB_FILE), str(directory / MERGES_FILE)))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    rust.decoder = decoders.ByteLevel()
    return rust


def _backend(directory: Path, settings: _Settings) -> tuple[_RustTokenizer, bool]:
    """The Rust tokenizer, and whether to build its post-processor from the flags (no tokenizer.json)."""
    if (directory / TOKENIZER_FILE).is_file():
        return _RustTokenizer.from_file(str(directory / TOKENIZER_FILE)), False
    missing = [name for name in (VOCAB_FILE, MERGES_FILE) if not (directory / name).is_file()]
    if missing:
        raise TokenizerLoadError(directory, f"no {TOKENIZER_FILE}, and no {' + '.join(missing)} "
                                            "for a byte-level BPE either")
    return _byte_level_bpe(directory, settings.add_prefix_space), True


class Tokenizer:
    """A model folder's tokenizer, offline. Thread-safe for encode/decode (the Rust core is)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        if not directory.is_dir():
            raise TokenizerLoadError(directory, "not a directory")
        settings = _read_settings(directory)
        try:
            rust, rebuild = _backend(directory, settings)
        except Exception as exc:   # the Rust loader raises plain Exceptions
            if isinstance(exc, TokenizerLoadError):
                raise
            raise TokenizerLoadError(directory, f"{type(exc).__name__}: {exc}") from None
        # As TokenizersBackend._post_init: split out before BPE, skipped by skip_special_tokens.
        rust.add_special_tokens([*settings.named.values(), *settings.extra])
        self._rust = rust
        self._special_strings = {k: str(t.content) for k, t in settings.named.items()}
        self._ids = {k: self._require_id(t.content) for k, t in settings.named.items()}
        if rebuild:
            self._rust.post_processor = self._template_processor(bool(settings.add_bos),
                                                                 bool(settings.add_eos))
        added = self._rust.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        #: Added tokens are stored as their text, not in the byte-level alphabet.
        self._added_ids = frozenset(added)
        self.chat_template = OPT_FALLBACK
        if settings.chat_template is not None:
            try:
                self.chat_template = ChatTemplate(settings.chat_template, self._special_strings)
            except ValueError as exc:
                raise TokenizerLoadError(directory, str(exc)) from None

    def _template_processor(self, add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
        """transformers' ``update_post_processor``: ``[bos] $A [eos]`` as the flags say."""
        specials: list[tuple[str, int]] = []
        single = "$A:0"
        if add_bos and "bos_token" in self._ids:
            single = f"{self._special_strings['bos_token']}:0 {single}"
            specials.append((self._special_strings["bos_token"], self._ids["bos_token"]))
        if add_eos and "eos_token" in self._ids:
            single = f"{single} {self._special_strings['eos_token']}:0"
            specials.append((self._special_strings["eos_token"], self._ids["eos_token"]))
        return processors.TemplateProcessing(single=single, special_tokens=specials)

    def _require_id(self, token: str) -> int:
        token_id = self._rust.token_to_id(token)
        if token_id is None:
            raise TokenizerLoadError(self._directory, f"special token {token!r} is not in the vocabulary")
        return int(token_id)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        return cls(Path(path))

    @classmethod
    def default(cls) -> Tokenizer:
        """The shipped OPT tokenizer (`config/tokenizers/opt`), loaded once per process."""
        return load_tokenizer(DEFAULT_TOKENIZER_DIR)

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def backend(self) -> _RustTokenizer:
        return self._rust

    @property
    def bos_token_id(self) -> int | None:
        return self._ids.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._ids.get("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._ids.get("pad_token")

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens' strings (``bos_token`` ...), as chat templates receive them."""
        return dict(self._special_strings)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit, added tokens included."""
        return int(self._rust.get_vocab_size(with_added_tokens=True))

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` as HF's ``tokenizer(text)``."""
        return list(self._rust.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self._rust.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids the tokenizer does not know (OPT's 7 padding rows) are skipped."""
        return str(self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    options: ChatOptions = DEFAULT_CHAT_OPTIONS,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """As transformers' ``apply_chat_template(..., tokenize=True)``; raises ``ChatTemplateError``."""
        text = self.chat_template.render(messages, options, tools)
        return self.encode(text, add_special_tokens=self.chat_template.add_special_tokens or options.add_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one id contributes (OpenAI logprobs' ``bytes``; may split a character)."""
        token = self._rust.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_ids or not isinstance(self._rust.decoder, decoders.ByteLevel):
            return self.decode([token_id], skip_special_tokens=False).encode(_UTF8)
        alphabet = _byte_level_alphabet()
        return bytes(alphabet[ch] for ch in token if ch in alphabet)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string (byte-level alphabet, e.g. 'Ġthe'), or None for unknown ids."""
        token = self._rust.id_to_token(token_id)
        return None if token is None else str(token)


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` ('Ġ' → space)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(_BYTE_VALUES):
        if b not in printable:
            printable.append(b)
            chars.append(_BYTE_VALUES + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@lru_cache(maxsize=8)
def _cached(directory: Path) -> Tokenizer:
    return Tokenizer(directory)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """`Tokenizer.from_dir`, loaded once per process and folder."""
    return _cached(Path(path).resolve())
