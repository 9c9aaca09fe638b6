"""OPT tokenization for the control plane: text <-> ids, streaming detokenization, chat prompts.

This module owns:

* `Tokenizer`: the OPT byte-level BPE (GPT-2 merges, fairseq/RoBERTa id order) loaded offline from
  `config/tokenizers/opt/` with the Rust `tokenizers` library. It reproduces HF's
  `AutoTokenizer.from_pretrained("facebook/opt-*")`: every encoded string gets a leading `</s>`
  (id 2, OPT's BOS), `</s>` and `<pad>` are the special tokens, and text is never normalised.
* `IncrementalDecoder`: turns a stream of generated ids into text deltas whose concatenation is
  exactly `Tokenizer.decode(generated_ids)`, holding back bytes of a UTF-8 character that is split
  across tokens (emoji, CJK) until the character is complete, as vLLM's detokenizer does.
* `apply_chat_template`: the documented prompt format used for `/v1/chat/completions` (OPT ships
  no chat template).

Nothing here downloads anything, and nothing imports torch or ray: the ingress runs on CPU-only
Serve replicas.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer

__all__ = [
    "ASSISTANT_ROLE",
    "DEFAULT_TOKENIZER_DIR",
    "IncrementalDecoder",
    "SYSTEM_ROLE",
    "Tokenizer",
    "USER_ROLE",
    "apply_chat_template",
]

# Resolved from this file, not the working directory: Serve replicas and tests start anywhere.
_REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER_DIR = _REPO_ROOT / "config" / "tokenizers" / "opt"

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"

# Fallbacks when special_tokens_map.json is absent; these are what facebook/opt-* publishes.
_DEFAULT_BOS = "</s>"
_DEFAULT_EOS = "</s>"
_DEFAULT_PAD = "<pad>"

_UTF8 = "utf-8"
# The ByteLevel decoder of `tokenizers` replaces invalid UTF-8 (Rust's from_utf8_lossy); Python's
# "replace" handler substitutes the same maximal subparts, so streamed and full decodes agree.
_UTF8_ERRORS = "replace"


def _byte_level_alphabet() -> dict[str, int]:
    """Map GPT-2's printable stand-in characters back to the raw bytes they encode.

    Byte-level BPE spells every byte as a visible unicode character (space is 'Ġ', newline 'Ċ');
    this is the inverse of GPT-2's `bytes_to_unicode`.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    byte_space = 256
    for b in range(byte_space):
        if b not in printable:
            printable.append(b)
            chars.append(byte_space + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _read_special_tokens(directory: Path) -> dict[str, str]:
    """Special-token strings from HF's special_tokens_map.json (values may be dicts or strings)."""
    path = directory / SPECIAL_TOKENS_FILE
    if not path.exists():
        return {"bos_token": _DEFAULT_BOS, "eos_token": _DEFAULT_EOS, "pad_token": _DEFAULT_PAD}
    raw: dict[str, object] = json.loads(path.read_text(encoding=_UTF8))
    out: dict[str, str] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            out[key] = str(value["content"])
        elif isinstance(value, str):
            out[key] = value
    return out


class Tokenizer:
    """The OPT tokenizer, offline. Thread-safe for encode/decode (the Rust core is)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._rust = _build_rust_tokenizer(directory)
        specials = _read_special_tokens(directory)
        self._bos_id = self._require_id(specials.get("bos_token", _DEFAULT_BOS))
        self._eos_id = self._require_id(specials.get("eos_token", _DEFAULT_EOS))
        self._pad_id = self._require_id(specials.get("pad_token", _DEFAULT_PAD))
        # HF's OPT tokenizer treats exactly the tokens named in special_tokens_map as special
        # (bos = eos = unk = "</s>", pad = "<pad>"); "<s>", "<unk>", "<mask>" are ordinary tokens.
        special_strings = sorted(set(specials.values()))
        self._rust.add_special_tokens(
            [
                AddedToken(s, single_word=False, lstrip=False, rstrip=False, normalized=True)
                for s in special_strings
            ]
        )
        self._special_ids = frozenset(self._require_id(s) for s in special_strings)
        self._token_bytes = self._build_token_bytes()

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a directory holding vocab.json, merges.txt (and special_tokens_map.json)."""
        return cls(Path(path))

    @classmethod
    def default(cls) -> Tokenizer:
        """The shipped OPT tokenizer (`config/tokenizers/opt`), loaded once per process."""
        return _default_tokenizer()

    def _require_id(self, token: str) -> int:
        token_id = self._rust.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in {self._directory / VOCAB_FILE}")
        return int(token_id)

    def _build_token_bytes(self) -> list[bytes]:
        """Raw bytes of every id, so streaming never has to re-decode the whole output."""
        alphabet = _byte_level_alphabet()
        table: list[bytes] = []
        for token_id in range(self.vocab_size):
            token = self._rust.id_to_token(token_id)
            if token is None:  # a hole in the id space; decode skips it too
                table.append(b"")
            elif token_id in self._special_ids:
                table.append(token.encode(_UTF8))
            else:
                table.append(bytes(alphabet[ch] for ch in token))
        return table

    # ---- ids of note --------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int:
        return self._bos_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_id

    @property
    def pad_token_id(self) -> int:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can emit (50,265 for OPT; the model's embedding has 50,272 rows)."""
        return int(self._rust.get_vocab_size(with_added_tokens=True))

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def __len__(self) -> int:
        return self.vocab_size

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; with `add_bos`, a leading `</s>` exactly as HF OPT adds it."""
        ids = list(self._rust.encode(text, add_special_tokens=False).ids)
        return [self._bos_id, *ids] if add_bos else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = True) -> list[list[int]]:
        """`encode` for many texts, parallelised inside the Rust core."""
        encodings = self._rust.encode_batch(list(texts), add_special_tokens=False)
        prefix = [self._bos_id] if add_bos else []
        return [prefix + list(e.ids) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids the tokenizer does not know (the model's 7 padding rows) are skipped.

        No `clean_up_tokenization_spaces`: it would break decode(encode(text)) == text and make
        streamed text differ from the full response.
        """
        return str(self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """Raw UTF-8 bytes a single id contributes to the output (b'' for unknown ids)."""
        if 0 <= token_id < len(self._token_bytes):
            return self._token_bytes[token_id]
        return b""

    def id_to_token(self, token_id: int) -> str | None:
        """The BPE token string (byte-level alphabet, e.g. 'Ġthe'), or None for unknown ids."""
        token = self._rust.id_to_token(token_id)
        return None if token is None else str(token)


def _build_rust_tokenizer(directory: Path) -> _RustTokenizer:
    vocab = directory / VOCAB_FILE
    merges = directory / MERGES_FILE
    for path in (vocab, merges):
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file missing: {path}")
    rust = _RustTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    # OPT's GPT2Tokenizer config says add_prefix_space=false: "Hello" and " Hello" differ.
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    return rust


@lru_cache(maxsize=1)
def _default_tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_TOKENIZER_DIR)


class IncrementalDecoder:
    """Streaming detokenizer: one generated id in, the new text out.

    Concatenating every `step` result and the final `flush` gives exactly
    `tokenizer.decode(generated_ids, skip_special_tokens)`. Byte-level BPE spells each token as raw
    bytes, so a token can end in the middle of a UTF-8 character (an emoji is 4 bytes, often 2-3
    tokens); those bytes are held back until the character completes, never emitted as U+FFFD.

    `prompt_ids` are kept for API parity with vLLM's detokenizer (whose SentencePiece models need
    the left context to place spaces). Byte-level BPE text is context-free, and the streamed text
    must equal the non-streamed `decode(generated_ids)`, so the prompt does not change the output.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.prompt_ids: list[int] = list(prompt_ids)
        self.output_ids: list[int] = []
        self._utf8 = codecs.getincrementaldecoder(_UTF8)(errors=_UTF8_ERRORS)
        self._text_parts: list[str] = []

    def step(self, token_id: int) -> str:
        """Consume one generated id; return the text it completes ('' while a char is split)."""
        self.output_ids.append(token_id)
        if self._skip_special and token_id in self._tokenizer.special_token_ids:
            return ""
        delta = self._utf8.decode(self._tokenizer.token_bytes(token_id))
        if delta:
            self._text_parts.append(delta)
        return delta

    def extend(self, token_ids: Iterable[int]) -> str:
        """`step` over several ids, returning their joined delta."""
        return "".join(self.step(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of the stream: emit held-back bytes (as U+FFFD, as a full decode would)."""
        delta = self._utf8.decode(b"", final=True)
        if delta:
            self._text_parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    @property
    def has_pending_bytes(self) -> bool:
        """True while an incomplete UTF-8 character is held back."""
        pending, _ = self._utf8.getstate()
        return bool(pending)


# ---- chat template -------------------------------------------------------------------------------

SYSTEM_ROLE = "system"
USER_ROLE = "user"
ASSISTANT_ROLE = "assistant"

_ROLE_PREFIX: dict[str, str] = {
    SYSTEM_ROLE: "System:",
    USER_ROLE: "User:",
    ASSISTANT_ROLE: "Assistant:",
}
_TURN_SEPARATOR = "\n"
_GENERATION_PROMPT = _ROLE_PREFIX[ASSISTANT_ROLE]


def apply_chat_template(messages: Sequence[Mapping[str, str]]) -> str:
    """Render chat messages as an OPT prompt. OPT has no chat template, so the project fixes one:

    * one line per message, ``"<Role>: <content>"`` with Role in System / User / Assistant and the
      content stripped of surrounding whitespace (an empty content leaves just ``"<Role>:"``);
    * system messages come first (in their given order), then the others in their given order;
    * lines are joined by a single newline, and the prompt ends with a final ``"Assistant:"`` line
      (no trailing space: the model's first token usually carries its own leading space).

    Example: ``[{"role": "user", "content": "Hi"}]`` -> ``"User: Hi\\nAssistant:"``.

    Raises ValueError on an unknown role or a message without role/content.
    """
    system_lines: list[str] = []
    turn_lines: list[str] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        content = message.get("content")
        if role not in _ROLE_PREFIX:
            raise ValueError(f"message {index}: unsupported role {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {index}: content must be a string")
        text = content.strip()
        line = f"{_ROLE_PREFIX[role]} {text}" if text else _ROLE_PREFIX[role]
        (system_lines if role == SYSTEM_ROLE else turn_lines).append(line)
    return _TURN_SEPARATOR.join([*system_lines, *turn_lines, _GENERATION_PROMPT])
