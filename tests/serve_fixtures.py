"""A small real tokenizer, built offline with the `tokenizers` library, for serving tests.

``write_tokenizer(folder, vocab_size)`` trains a BPE tokenizer (SentencePiece-style: words marked with
"▁", a BOS added in front, like Llama's) on a fixed English text, and writes `tokenizer.json` and a
`tokenizer_config.json` with its special tokens and a chat template into a checkpoint folder, as a
Hugging Face checkpoint has them. Training is deterministic, so the same call gives the same ids.
"""

from __future__ import annotations

import json
import os
import string

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")  # ids 0..5
BOS, EOS = "<s>", "</s>"

# Each message: its role's marker, the text, then EOS; the prompt ends by opening the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. A compiled plan runs its ranks once and keeps
them running; the server admits requests into free batch slots between rounds. Every token that a
rank samples goes back to the scheduler, which streams it to the client as text. Hello world, how
are you today? One two three four five six seven eight nine ten. Serving large language models on
mixed clusters of graphics processors is a question of placing operators where they run best."""


def write_tokenizer(folder: str, vocab_size: int = 320, chat_template: str | None = CHAT_TEMPLATE,
                    corpus=None, max_length: int = 4096) -> str:
    """Writes tokenizer.json + tokenizer_config.json into `folder` (created if needed); returns it.
    `corpus`: the lines to train on (default: a fixed English text; a larger vocabulary needs more)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = [c for c in string.printable if c not in string.whitespace] + ["▁"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator(corpus if corpus is not None else _CORPUS.splitlines() * 4, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "unk_token": "<unk>", "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return folder


class FakeEngine:
    """The serving engine's interface (opweave.serve.engine.Engine) over a deterministic token source.

    Continuous batching in miniature: a thread runs rounds every `round_s`; each round admits waiting
    requests into free slots (at most `max_batch` run) and gives every running request one token.
    Request r's i-th token is `echo(prompt)[i % len]`, the prompt's ids without special tokens, so
    a reply repeats its prompt; at `eos_after` tokens the model's EOS comes instead. `pause()` stops
    the rounds (requests then wait), `fail(msg)` kills it like a dead rank.
    """

    model = "tiny-fake"
    vocab_size = 320  # write_tokenizer's default

    def __init__(self, context: int = 64, max_batch: int = 16, max_queue: int = 256, round_s: float = 0.002,
                 eos_after: int | None = None, special_ids: tuple[int, ...] = tuple(range(len(SPECIAL_TOKENS)))):
        import collections
        import threading

        from opweave.serve.engine import Event, QueueFull

        self._Event, self._QueueFull = Event, QueueFull
        self.context, self.max_batch, self.max_queue, self.round_s = context, max_batch, max_queue, round_s
        self.eos_token_ids = (SPECIAL_TOKENS.index(EOS),)
        self.eos_after, self._special = eos_after, frozenset(special_ids)
        self.healthy, self.error = False, None
        self.rejected = 0
        self.submitted: dict[int, tuple[list[int], object]] = {}   # id -> (prompt ids, sampling)
        self.cancelled: list[int] = []
        self.finished: dict[int, str] = {}
        self._waiting: collections.deque = collections.deque()
        self._running: dict[int, dict] = {}
        self._rounds: collections.deque = collections.deque(maxlen=64)
        self._lock = threading.Lock()
        self._go = threading.Event()
        self._halt = threading.Event()
        self._next = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def reply(prompt_ids: list[int], n: int, special=frozenset(range(len(SPECIAL_TOKENS)))) -> list[int]:
        """The first `n` tokens the fake gives for `prompt_ids` (without EOS)."""
        echo = [t for t in prompt_ids if t not in special] or [len(SPECIAL_TOKENS)]
        return [echo[i % len(echo)] for i in range(n)]

    def start(self) -> None:
        self.healthy = True
        self._go.set()
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._halt.set()
        self._go.set()
        self._thread.join(timeout_s)
        self._end_all("cancelled", None)
        self.healthy, self.error = False, self.error or "the engine stopped"

    def pause(self) -> None:
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def fail(self, error: str) -> None:
        self.healthy, self.error = False, error
        self._end_all("error", error)

    def submit(self, prompt_ids, sampling, on_event) -> int:
        if not self.healthy:
            raise RuntimeError(self.error or "the engine is not running")
        if len(prompt_ids) >= self.context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; at most {self.context - 1} fit")
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                self.rejected += 1
                raise self._QueueFull(f"{self.max_queue} requests are already waiting")
            rid, self._next = self._next, self._next + 1
            self.submitted[rid] = (list(prompt_ids), sampling)
            self._waiting.append((rid, dict(prompt=list(prompt_ids), sampling=sampling, on_event=on_event, n=0,
                                            cancel=False)))
        return rid

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self.cancelled.append(request_id)
            for rid, req in list(self._waiting) + list(self._running.items()):
                if rid == request_id:
                    req["cancel"] = True

    def stats(self) -> dict:
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting), "rejected": self.rejected,
                    "round_s": {(0, 0): list(self._rounds)}}

    def _loop(self) -> None:
        import time

        while not self._halt.is_set():
            self._go.wait()
            start = time.perf_counter()
            with self._lock:
                while self._waiting and len(self._running) < self.max_batch:
                    rid, req = self._waiting.popleft()
                    self._running[rid] = req
                running = list(self._running.items())
            for rid, req in running:
                self._step(rid, req)
            time.sleep(self.round_s)
            self._rounds.append(time.perf_counter() - start)

    def _step(self, rid: int, req: dict) -> None:
        if req["cancel"]:
            return self._finish(rid, req, "cancelled")
        sampling = req["sampling"]
        if self.eos_after is not None and req["n"] == self.eos_after:
            token = self.eos_token_ids[0]
        else:
            token = self.reply(req["prompt"], req["n"] + 1, self._special)[-1]
        req["n"] += 1
        req["on_event"](self._Event(token, None))
        if token in self.eos_token_ids or token in sampling.stop_token_ids:
            self._finish(rid, req, "stop")
        elif req["n"] >= sampling.max_tokens:
            self._finish(rid, req, "length")

    def _finish(self, rid: int, req: dict, reason: str, error: str | None = None) -> None:
        with self._lock:
            if self._running.pop(rid, None) is None:
                return
            self.finished[rid] = reason
        req["on_event"](self._Event(None, reason, error))

    def _end_all(self, reason: str, error: str | None) -> None:
        with self._lock:
            left = list(self._waiting) + list(self._running.items())
            self._waiting.clear()
            self._running.clear()
            for rid, _ in left:
                self.finished[rid] = reason
        for _, req in left:
            req["on_event"](self._Event(None, reason, error))


def wait_until(cond, timeout: float = 10.0) -> bool:
    """Polls `cond` until it holds or `timeout` seconds pass (a guard against a hang, not a budget)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()
