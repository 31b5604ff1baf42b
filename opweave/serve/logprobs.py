"""Log-probabilities in OpenAI's response shapes.

The engine gives each output token its log-probability and the top ones (`engine.Event.logprob`:
(log-probability, ((id, log-probability), ...)), most likely first), and a completion that
`echo`es its prompt with `logprobs` gets each prompt token's too (`Event.prompt_logprobs`, the
first prompt token having none). A token's text is what the tokenizer decodes for it alone.

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

    def __init__(self, tokenizer, kind: str, top: int):
        self.tokenizer, self.kind, self.top = tokenizer, kind, top
        self.offset = 0  # completions: the text offset of the next token

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def body(self, items: list[Entry]) -> dict:
        """The logprobs object of `items` (the tokens since the previous call)."""
        if self.kind == "chat":
            return {"content": [self._chat(e) for e in items]}
        tokens, offsets, tops = [], [], []
        for e in items:
            text = self.text(e.token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            tops.append(None if e.top is None else self._top_dict(e))
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in items], "top_logprobs": tops,
                "text_offset": offsets}

    def _top_dict(self, e: Entry) -> dict:
        """{text: logprob} of the top tokens and the token itself (OpenAI's completions shape)."""
        out = {}
        for token, lp in e.top[:self.top]:
            out.setdefault(self.text(token), lp)
        out.setdefault(self.text(e.token), e.logprob)
        return out

    def _chat(self, e: Entry) -> dict:
        def one(token: int, lp: float) -> dict:
            text = self.text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in (e.top or ())[:self.top]]}
