"""Text in and out of the server: the checkpoint's tokenizer, its chat template, and streaming detokenization.

`Tokenizer.from_folder` loads `tokenizer.json` + `tokenizer_config.json` (special tokens, chat template)
from a Hugging Face checkpoint folder through the standard `transformers` classes, so the ids and the
chat prompt are the ones the model was trained with. `TextStream` turns a request's tokens, one at a
time, into text deltas: it never emits half a character, and it holds back the end of the text that
could still become a stop string.

transformers is imported inside `from_folder` because a cold import takes seconds.
"""

from __future__ import annotations

import os

from opweave.errors import OpWeaveError

# Note: a byte-level tokenizer may need several tokens for one character; until they arrive the
# decoded text ends in U+FFFD (the replacement character), which is never emitted.
_INCOMPLETE = "\ufffd"


class Tokenizer:
    """A Hugging Face fast tokenizer with the few operations the server needs."""

    def __init__(self, hf_tokenizer, sampling_defaults: tuple[float, float] = (0.0, 1.0)):
        self.hf = hf_tokenizer
        self.special_ids = frozenset(int(i) for i in hf_tokenizer.all_special_ids)
        # (temperature, top_p) of a request that gives neither (`generation_defaults`)
        self.sampling_defaults = sampling_defaults

    @classmethod
    def from_folder(cls, folder: str) -> "Tokenizer":
        """Loads the tokenizer of a checkpoint folder (OpWeaveError when it has none or it is unreadable)."""
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise OpWeaveError(f"{folder}: no tokenizer.json (the server needs the checkpoint's fast tokenizer)")
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, ImportError, KeyError, AttributeError):
            # A tokenizer_class this transformers does not know: the generic fast class reads the same files.
            try:
                hf = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
            except (OSError, ValueError) as e:
                raise OpWeaveError(f"{folder}: cannot load the tokenizer: {str(e).splitlines()[0]}") from None
        if not getattr(hf, "is_fast", False):
            raise OpWeaveError(f"{folder}: the tokenizer loaded is not a fast (tokenizer.json) tokenizer")
        return cls(hf, generation_defaults(folder))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the special tokens the tokenizer adds (BOS)."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template applied to `messages`, ending with the assistant's turn (ValueError without a template)."""
        if not self.has_chat_template:
            raise ValueError("the model's tokenizer has no chat template: use /v1/completions")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes the special tokens itself (BOS included): do not add them twice.
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def generation_defaults(folder: str) -> tuple[float, float]:
    """(temperature, top_p) for requests that give neither: the checkpoint's recommendation in
    `generation_config.json` when it samples (`do_sample: true`; missing values are 1.0), else
    greedy (0.0, 1.0). A file that cannot be read is an OpWeaveError."""
    import json

    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return 0.0, 1.0
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise OpWeaveError(f"{path}: cannot read ({e})") from None
    if not isinstance(config, dict) or not config.get("do_sample"):
        return 0.0, 1.0
    temperature, top_p = config.get("temperature", 1.0), config.get("top_p", 1.0)
    if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise OpWeaveError(f"{path}: temperature must be a number in [0, 2], got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise OpWeaveError(f"{path}: top_p must be a number in (0, 1], got {top_p!r}")
    return float(temperature), float(top_p)


class TextStream:
    """One request's tokens -> text deltas, with stop strings matched on the text.

    Decoding re-reads only a short window: the tokens since the last emitted text plus the ones before
    it (`_prefix`), so the spacing a tokenizer puts between words comes out right and each step costs a
    few tokens, not the whole output.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0        # first id of the decode window
        self._read = 0          # ids[:_read] are already part of `text`
        self.text = ""          # all text decoded so far (cut at a stop string once one matched)
        self._sent = 0          # text[:_sent] has been handed out
        self.stopped = False    # a stop string matched: the request should end

    def add(self, token: int) -> str:
        """Takes one token; returns the text that can be sent now (possibly '')."""
        if self.stopped:
            return ""
        self._ids.append(token)
        if token in self._tok.special_ids:
            return ""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        start = len(self.text)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        if self._stop:
            # A match may straddle the new text and what came before it.
            window = max(0, start - self._hold)
            hits = [i for i in (self.text.find(s, window) for s in self._stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                return self.flush()
        return self._take(len(self.text) - self._hold)

    def flush(self) -> str:
        """The text held back so far (at the end of the request)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out, self._sent = self.text[self._sent:end], end
        return out
