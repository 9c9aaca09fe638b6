"""Streaming detokenization: generated ids in, text deltas out, exact through multi-byte characters.

This module owns `IncrementalDecoder`, built on the ``tokenizers`` library's own
``decoders.DecodeStream`` (what vLLM's fast detokenizer uses): it re-decodes a short window of
recent ids and emits only text past what it already emitted, holding a token back while the
window's text ends in an incomplete UTF-8 character (an emoji's 4 bytes spread over tokens,
byte-fallback pieces), so a delta never carries a stray U+FFFD that a later token completes.

The invariant the ingress relies on (tested for OPT and SmolLM2 with emoji and CJK): the
concatenation of every `step` result and the final `flush` equals
``tokenizer.decode(generated_ids, skip_special_tokens)``. `flush` closes the stream against that
full decode, so bytes still held at the end (a truncated character) come out as the full decode
renders them. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers.decoders import DecodeStream

from fastserve.tokenizer import Tokenizer

__all__ = ["IncrementalDecoder"]


class IncrementalDecoder:
    """One generated id in, the new text out.

    `prompt_ids` are kept for API parity with vLLM's detokenizer but do not seed the stream: the
    streamed text must equal the non-streamed ``decode(generated_ids)`` (a SentencePiece model's
    first generated word then has no leading space, in both).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.prompt_ids: list[int] = list(prompt_ids)
        self.output_ids: list[int] = []
        self._text_parts: list[str] = []
        self._held_from = 0       # output_ids[_held_from:] have not produced text yet
        self._broken = False      # DecodeStream refused a step: deltas come from full decodes

    def step(self, token_id: int) -> str:
        """Consume one generated id; return the text it completes ('' while a char is split)."""
        self.output_ids.append(token_id)
        delta = self._full_decode_delta() if self._broken else self._stream_step(token_id)
        if delta:
            self._text_parts.append(delta)
            self._held_from = len(self.output_ids)
        return delta

    def _stream_step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer.backend, token_id) or ""
        except Exception:   # DecodeStreamError (a decoder whose text is not prefix-stable)
            self._broken = True
            return self._full_decode_delta()

    def _full_decode_delta(self, final: bool = False) -> str:
        """What the full decode has past the emitted text (held while it ends mid-character)."""
        full = self._tokenizer.decode(self.output_ids, skip_special_tokens=self._skip_special)
        emitted = self.text
        if not full.startswith(emitted) or (not final and full.endswith("\ufffd")):
            return ""
        return full[len(emitted):]

    def extend(self, token_ids: Iterable[int]) -> str:
        """`step` over several ids, returning their joined delta."""
        return "".join(self.step(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of the stream: what the full decode has beyond the emitted text (a held-back
        partial character, as U+FFFD)."""
        delta = self._full_decode_delta(final=True)
        if delta:
            self._text_parts.append(delta)
            self._held_from = len(self.output_ids)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    @property
    def has_pending_bytes(self) -> bool:
        """True while consumed ids hold text back (an incomplete UTF-8 character)."""
        held = self.output_ids[self._held_from:]
        return bool(held) and bool(self._tokenizer.decode(held, skip_special_tokens=self._skip_special))
