"""Streaming detokenization on ``tokenizers``' ``DecodeStream`` (as vLLM's): a token is held back while
the text ends mid UTF-8 character, so no delta carries a stray U+FFFD. Invariant the ingress relies
on: every ``step`` result plus ``flush`` equals ``decode(generated_ids, skip_special_tokens)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers.decoders import DecodeStream

from fastserve.tokenizer import Tokenizer

__all__ = ["IncrementalDecoder"]


class IncrementalDecoder:
    """`prompt_ids` do not seed the stream: the text must equal the non-streamed decode."""

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
        full = self._tokenizer.decode(self.output_ids, skip_special_tokens=self._skip_special)
        emitted = self.text
        if not full.startswith(emitted) or (not final and full.endswith("\ufffd")):
            return ""
        return full[len(emitted):]

    def extend(self, token_ids: Iterable[int]) -> str:
        return "".join(self.step(t) for t in token_ids)

    def flush(self) -> str:
        """At the end: a held-back partial character, as the full decode renders it."""
        delta = self._full_decode_delta(final=True)
        if delta:
            self._text_parts.append(delta)
            self._held_from = len(self.output_ids)
        return delta

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    @property
    def has_pending_bytes(self) -> bool:
        held = self.output_ids[self._held_from:]
        return bool(held) and bool(self._tokenizer.decode(held, skip_special_tokens=self._skip_special))
