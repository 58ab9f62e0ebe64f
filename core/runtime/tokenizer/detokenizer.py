"""Incremental detokenization that never emits broken UTF-8 and finds stop strings split across tokens."""

from __future__ import annotations

from radixlm.core.runtime.tokenizer.fast_path import decoder_for

# Decoding restarts from a few tokens back so that tokenizers whose pieces depend on their left
# neighbour (SentencePiece spaces, byte-level multi-byte characters) decode the same as in one go.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool, stop: list[str], no_stop_trim: bool,
                 lazy: bool = False) -> None:
        """lazy: nobody reads the text before the end and there are no stop strings to find, so `add`
        only records ids and `flush` decodes the whole output once (two tokenizer calls per token saved)."""
        assert not (lazy and stop), "stop strings are found incrementally"
        self.lazy = lazy
        self._decoder = decoder_for(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.text = ""  # stable decoded text so far (complete characters only)
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to the tail of self.text
        self.read_offset = 0
        self.emitted = 0  # characters already handed to a stream consumer
        self.matched_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self.skip_special_tokens)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Feeds one token. Returns the matched stop string when one now appears in the text, else None.
        With check_stop False (before min_new_tokens) stop strings are not looked for."""
        self.ids.append(token_id)
        if self.lazy:
            return None
        return self._advance(final=False, check_stop=check_stop)

    def replace_tail(self, count: int, new_ids: list[int]) -> str | None:
        """Replaces the last `count` ids (fully decoded) by `new_ids`, which write the same text and more
        (jump-forward re-tokenized the boundary). Returns a matched stop string, as `add` does."""
        if self.lazy:  # nothing decoded yet: the ids are all there is
            del self.ids[len(self.ids) - count :]
            self.ids.extend(new_ids)
            return None
        if count:
            start = max(0, len(self.ids) - count - _CONTEXT_TOKENS)
            before = self._decode(self.ids[start : len(self.ids) - count])
            tail = self._decode(self.ids[start:])[len(before) :]
            self.text = self.text[: len(self.text) - len(tail)]
            del self.ids[len(self.ids) - count :]
            self.read_offset = len(self.ids)
            self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        for token_id in new_ids:
            matched = self.add(token_id)
            if matched is not None:
                return matched
        return None

    def flush(self) -> None:
        """At the end of the output: whatever bytes are still pending are decoded as they are."""
        if self.matched_stop is None and self.read_offset < len(self.ids):
            self._advance(final=True)

    def _advance(self, final: bool, check_stop: bool = True) -> str | None:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if not final and (full.endswith("\ufffd") or len(full) <= len(prefix_text)):
            return None  # an incomplete UTF-8 sequence (or nothing visible yet): wait for more tokens
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += full[len(prefix_text) :]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        return self._find_stop(searched_from) if check_stop else None

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self.matched_stop = s
        self.text = self.text[: pos + len(s)] if self.no_stop_trim else self.text[:pos]
        return s

    def take_new_text(self, final: bool) -> str:
        """Text not yet streamed. Unless final, holds back a tail that may be the start of a stop string."""
        end = len(self.text)
        if not final and self.stop:
            end -= self._stop_prefix_overlap()
        chunk = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return chunk

    def _stop_prefix_overlap(self) -> int:
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest
