"""Text in and out of the server: the tokenizer behind one lock (transformers' fast tokenizers are not safe to
call from several threads at once), and `TextStream`, a request's generated text as it grows chunk by chunk."""
from __future__ import annotations

import threading

from ..text import encode_chat, encode_text


class Tokens:
    """The target's tokenizer, one call at a time."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._lock = threading.Lock()

    def chat(self, messages) -> list[int]:
        """Token ids of a chat in the tokenizer's chat template (generation prompt appended)."""
        with self._lock:
            return encode_chat(self.tok, messages, strict=True)

    def text(self, prompt: str) -> list[int]:
        """Token ids of a raw prompt (the tokenizer's own BOS handling)."""
        with self._lock:
            return encode_text(self.tok, prompt, add_special_tokens=True)

    def decode(self, ids) -> str:
        with self._lock:
            return self.tok.decode(list(ids), skip_special_tokens=True)


class TextStream:
    """The text of one request's generated tokens, handed out as it grows: `push(tokens)` returns the new text
    that is final (a trailing incomplete UTF-8 character, or a tail that may start a stop string, waits for the
    next tokens); a stop token or stop string ends the text before it (`stopped`); `flush()` returns what was
    held back once the request ends."""

    def __init__(self, tokens: Tokens, stop_ids=(), stop_strings=()):
        self.tokens, self.stop_ids = tokens, set(int(i) for i in stop_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []  # generated ids before any stop token
        self.text = ""  # their text, cut at a stop string
        self.sent = 0  # characters handed out
        self.stopped = False  # a stop token or string ended the text

    def push(self, new) -> str:
        if self.stopped:
            return ""
        for t in new:
            if int(t) in self.stop_ids:
                self.stopped = True
                break
            self.ids.append(int(t))
        text = self.tokens.decode(self.ids)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            text = text[:cut]
        self.text = text
        if self.stopped:
            return self.flush()
        safe = len(text) - self._held(text)
        out = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _stop_at(self, text: str):
        lo = max(0, self.sent - max((len(s) for s in self.stop_strings), default=0))
        hits = [i for i in (text.find(s, lo) for s in self.stop_strings) if i >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """Characters at the end of `text` not handed out yet: an incomplete character, or the longest tail that
        is the start of a stop string."""
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        held = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held
