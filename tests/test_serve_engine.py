"""The serving engine on CPU ranks: requests admitted while the plan's ranks run (continuous
batching), greedy tokens identical to `opweave run`, cancellation, stop ids, a full queue, a rank
that dies, and a stop that leaves no process."""

import os
import threading

import pytest
import torch

from opweave.serve.engine import Engine, QueueFull, Sampling
from test_runtime import LAYERS, NEW_TOKENS, PROMPTS, compile_pinned, reference


class Collect:
    """Events per request; `wait()` until every submitted request ended."""

    def __init__(self):
        self.events, self.lock, self.ended = {}, threading.Lock(), threading.Condition()

    def callback(self, key):
        def on_event(ev):
            with self.ended:
                self.events.setdefault(key, []).append(ev)
                self.ended.notify_all()
        return on_event

    def tokens(self, key):
        return [e.token for e in self.events.get(key, []) if e.token is not None]

    def reason(self, key):
        evs = self.events.get(key, [])
        return evs[-1].finish_reason if evs else None

    def wait(self, keys, timeout=60):
        with self.ended:
            assert self.ended.wait_for(lambda: all(self.reason(k) for k in keys), timeout), self.events


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    """Every rank runs its decode rounds under NoHostSync (OPWEAVE_CHECK_SYNC): a serving round,
    the sampler included, must not synchronise with the host (it would break CUDA graph capture)."""
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    art = str(tmp_path_factory.mktemp("serve") / "art")
    compile_pinned(folder, "afd", art)  # three ranks: attention, FFN at TP 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPWEAVE_CHECK_SYNC", "1")
        engine = Engine(art, folder, max_queue=64)
        engine.start()
    yield engine, folder
    engine.stop()


@pytest.mark.slow
def test_requests_arriving_while_running_get_run_s_greedy_tokens(served):
    engine, folder = served
    got = Collect()
    first = [engine.submit(p, Sampling(max_tokens=NEW_TOKENS), got.callback(i)) for i, p in enumerate(PROMPTS[:2])]
    got.wait([0])  # the first request ended: the rest arrive while the second may still run
    for i, p in enumerate(PROMPTS[2:], start=2):
        engine.submit(p, Sampling(max_tokens=NEW_TOKENS), got.callback(i))
    got.wait(range(len(PROMPTS)))
    assert len(set(first)) == 2
    assert [tuple(got.tokens(i)) for i in range(len(PROMPTS))] == list(reference(folder))
    assert {got.reason(i) for i in range(len(PROMPTS))} == {"length"}
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["round_s"]


@pytest.mark.slow
def test_stop_ids_and_cancel(served):
    engine, folder = served
    want = reference(folder)[0]
    got = Collect()
    engine.submit(PROMPTS[0], Sampling(max_tokens=NEW_TOKENS, stop_token_ids=(want[1],)), got.callback("stop"))
    long = engine.submit(PROMPTS[1], Sampling(max_tokens=40), got.callback("long"))
    got.wait(["stop"])
    assert got.tokens("stop") == list(want[:2]) and got.reason("stop") == "stop"
    engine.cancel(long)
    got.wait(["long"])
    assert got.reason("long") == "cancelled" and len(got.tokens("long")) < 40
    engine.cancel(long)  # ended: nothing happens
    engine.submit(PROMPTS[3], Sampling(max_tokens=3), got.callback("after"))  # the slot was freed
    got.wait(["after"])
    assert got.tokens("after") == list(reference(folder)[3][:3])


@pytest.mark.slow
def test_bad_requests_and_a_full_queue(served):
    engine, _ = served
    with pytest.raises(ValueError, match="context of 64 allows at most 63"):
        engine.submit(list(range(1, 65)), Sampling(max_tokens=2), lambda ev: None)
    with pytest.raises(ValueError, match="temperature"):
        engine.submit([1, 2], Sampling(max_tokens=2, temperature=2.5), lambda ev: None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([10 ** 9], Sampling(max_tokens=2), lambda ev: None)
    got = Collect()
    keys = []
    with pytest.raises(QueueFull):
        for i in range(engine.max_queue + 1):  # none has a first token yet: they all wait
            engine.submit([5, 6, 7], Sampling(max_tokens=1), got.callback(i))
            keys.append(i)
    assert engine.stats()["rejected"] >= 1
    got.wait(keys)


@pytest.mark.slow
def test_a_dying_rank_fails_requests_in_flight_and_stop_leaves_no_process(tiny_checkpoint, tmp_path, monkeypatch):
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    art = str(tmp_path / "art")
    compile_pinned(folder, "afd", art)
    monkeypatch.setenv("OPWEAVE_FAULT_KILL", "1:30")  # rank 1 kills itself after round 30
    engine = Engine(art, folder)
    engine.start()
    got = Collect()
    engine.submit(PROMPTS[0], Sampling(max_tokens=60), got.callback(0))
    got.wait([0])
    assert got.reason(0) == "error" and "rank 1" in got.events[0][-1].error
    assert not engine.healthy and "rank 1" in engine.error
    with pytest.raises(RuntimeError):
        engine.submit([1], Sampling(max_tokens=1), lambda ev: None)
    pids = [p.pid for p in engine._ranks.procs.values()]
    engine.stop(timeout_s=5)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def sampled_reference(folder: str, prompt: list[int], n: int, temperature: float, top_p: float, seed: int):
    """transformers' logits, one step at a time, through the sampler on the whole vocabulary: what a
    plan must give whatever its TP split of the LM head."""
    from transformers import AutoModelForCausalLM

    from opweave.kernels.sampling import encode, sample

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager")
    ids, word = list(prompt), torch.tensor([encode(temperature, top_p, seed)])
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            ids.append(int(sample(logits, word, torch.tensor([len(ids) - 1]))[0]))
    return ids[len(prompt):]


@pytest.mark.slow
def test_sampled_requests_follow_their_seed_on_the_device(served):
    """The LM head is split over the FFN owner's TP 2: each rank samples its half of the vocabulary
    and the group agrees; the tokens equal the sampler's on the whole vocabulary, a seed repeats
    its tokens, and every rank reports its round times."""
    engine, folder = served
    got = Collect()
    runs = [("a", 0, 1.0, 1.0, 11), ("a again", 0, 1.0, 1.0, 11), ("b", 0, 1.0, 1.0, 12),
            ("nucleus", 2, 0.8, 0.6, 5), ("greedy", 1, 0.0, 1.0, 3)]
    for key, p, temperature, top_p, seed in runs:
        engine.submit(PROMPTS[p], Sampling(max_tokens=NEW_TOKENS, temperature=temperature, top_p=top_p, seed=seed),
                      got.callback(key))
    got.wait([r[0] for r in runs])
    assert got.tokens("a") == got.tokens("a again") and got.tokens("a") != got.tokens("b")
    for key, p, temperature, top_p, seed in runs:
        assert got.tokens(key) == sampled_reference(folder, PROMPTS[p], NEW_TOKENS, temperature, top_p, seed), key
    assert got.tokens("greedy") == list(reference(folder)[1])
    assert set(engine.stats()["round_s"]) == {(0, 0), (0, 1), (0, 2)}  # every rank, not only the leader
