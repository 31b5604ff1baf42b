"""Log-probabilities in OpenAI's response shapes.

The engine gives each output token its log-probability and the top ones (`engine.Event.logprob`:
(log-probability, ((id, log-probability), ...)), most likely first), and a completion that
`echo`es its prompt with `logprobs` gets each prompt token's too (`Event.prompt_logprobs`, the
first prompt token having none). A token's text is what it adds to the text decoded before it (the previous token as context, so a
SentencePiece word mark becomes its leading space, as vLLM and OpenAI give it); the top
alternatives at a position are read after the same previous token.

  - completions: `{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: lp}, ...],
    "text_offset": [...]}`, the echoed prompt's tokens first (its first token's entries null);
  - chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}]}]}`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Entry:
    """One token with its log-probability (None: the prompt's first token) and top ones."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None


def entries(ids, pairs) -> list[Entry]:
    """Entries of tokens `ids` from their engine pairs (None: no figure)."""
    return [Entry(t, None, None) if p is None else Entry(t, float(p[0]), tuple(p[1])) for t, p in zip(ids, pairs)]


class Formatter:
    """A choice's log-probabilities, built chunk by chunk (a stream's) or at once; `top` is the
    number of top log-probabilities the request asked for."""

    def __init__(self, tokenizer, kind: str, top: int, previous: int | None = None):
        """`previous`: the token before the first entry (the prompt's last, when the prompt is not
        echoed; None: the first entry starts the text)."""
        self.tokenizer, self.kind, self.top = tokenizer, kind, top
        self.offset = 0  # completions: the text offset of the next token
        self.previous = previous
        self._before = ""  # the previous token's own text (`body` sets it per entry)

    def text(self, token: int) -> str:
        """What `token` adds to the text after the previous token (alone when there is none)."""
        if self.previous is None:
            return self.tokenizer.decode([token])
        both = self.tokenizer.decode([self.previous, token])
        return both[len(self._before):] if both.startswith(self._before) else self.tokenizer.decode([token])

    def body(self, items: list[Entry]) -> dict:
        """The logprobs object of `items` (the tokens since the previous call)."""
        out = []
        for e in items:
            self._before = "" if self.previous is None else self.tokenizer.decode([self.previous])
            out.append(self._chat(e) if self.kind == "chat" else self._completion(e))
            self.previous = e.token
        if self.kind == "chat":
            return {"content": out}
        return {"tokens": [t for t, _, _ in out], "token_logprobs": [e.logprob for e in items],
                "top_logprobs": [top for _, top, _ in out], "text_offset": [o for _, _, o in out]}

    def _completion(self, e: Entry) -> tuple[str, dict | None, int]:
        """(the token's text, its {text: logprob} of the top tokens and itself, its text offset)."""
        text, offset = self.text(e.token), self.offset
        self.offset += len(text)
        if e.top is None:
            return text, None, offset
        top = {}
        for token, lp in e.top[:self.top]:
            top.setdefault(self.text(token), lp)
        top.setdefault(text, e.logprob)
        return text, top, offset

    def _chat(self, e: Entry) -> dict:
        def one(token: int, lp: float) -> dict:
            text = self.text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in (e.top or ())[:self.top]]}
