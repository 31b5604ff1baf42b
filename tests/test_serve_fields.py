"""Request fields on real ranks: top_k, min_p, min_tokens (EOS banned on the device) and
ignore_eos, through an AFD plan whose cuts carry each row's sampling word, against transformers'
logits through the same sampler on the whole vocabulary."""

from __future__ import annotations

import pytest
import torch

from opweave.kernels.sampling import ban_columns, sample
from opweave.serve.engine import Engine, Sampling
from test_runtime import LAYERS, PROMPTS, compile_pinned, reference
from test_serve_engine import Collect

N = 6


@pytest.fixture(scope="module")
def eos_served(tiny_checkpoint, tmp_path_factory):
    """A checkpoint whose EOS id is the greedy first token of PROMPTS[0]: a plain greedy request
    ends at once, so the EOS ban and ignore_eos are visible."""
    plain = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"])
    eos = reference(plain)[0][0]
    folder = tiny_checkpoint("llama", num_hidden_layers=LAYERS["llama"], eos_token_id=eos)
    art = str(tmp_path_factory.mktemp("fields") / "art")
    compile_pinned(folder, "afd", art)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPWEAVE_CHECK_SYNC", "1")
        engine = Engine(art, folder, max_queue=16)
        engine.start()
    yield engine, folder, eos
    engine.stop()


def expected(folder: str, prompt: list[int], s: Sampling, eos: int) -> tuple[list[int], str]:
    """transformers' logits one step at a time through the sampler, with the engine's word, ban
    and ends (EOS unless ignore_eos, after min_tokens; max_tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager")
    word = torch.tensor([s.word(len(prompt), s.seed)])
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < s.max_tokens:
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            banned = ban_columns((eos,), 0, logits.shape[-1], "cpu")
            token = int(sample(logits, word, torch.tensor([len(ids) - 1]), banned=banned)[0])
            ids.append(token)
            out.append(token)
            if token == eos and not s.ignore_eos and len(out) >= s.min_tokens:
                return out, "stop"
    return out, "length"


CASES = {
    "greedy ends on eos": Sampling(max_tokens=N, seed=0),
    "ignore_eos": Sampling(max_tokens=N, seed=0, ignore_eos=True),
    "min_tokens bans eos": Sampling(max_tokens=N, seed=0, min_tokens=3),
    "top_k and min_p": Sampling(max_tokens=N, temperature=1.3, seed=7, top_k=3, min_p=0.05, top_p=0.95),
    "top_k 1 is greedy": Sampling(max_tokens=N, temperature=1.0, seed=9, top_k=1, ignore_eos=True),
    "tiny top_p": Sampling(max_tokens=N, temperature=1.0, top_p=4e-7, seed=1, min_tokens=2),
}


@pytest.mark.slow
def test_fields_reach_the_device_sampler_and_the_scheduler(eos_served):
    engine, folder, eos = eos_served
    got = Collect()
    for key, s in CASES.items():
        engine.submit(PROMPTS[0], s, got.callback(key))
    got.wait(list(CASES))
    for key, s in CASES.items():
        want, reason = expected(folder, PROMPTS[0], s, eos)
        assert (got.tokens(key), got.reason(key)) == (want, reason), key
    assert got.tokens("greedy ends on eos") == [eos]
    assert eos not in got.tokens("min_tokens bans eos")[:3]
    assert len(got.tokens("ignore_eos")) == N and got.tokens("ignore_eos")[0] == eos
    assert got.tokens("top_k 1 is greedy") == got.tokens("ignore_eos")
    assert engine.healthy


def test_out_of_range_fields_are_refused_naming_them(eos_served):
    engine = eos_served[0]
    for s, param in ((Sampling(max_tokens=2, top_k=65), "top_k"), (Sampling(max_tokens=2, min_p=1.5), "min_p"),
                     (Sampling(max_tokens=2, min_tokens=3), "min_tokens"), (Sampling(max_tokens=2, top_p=0), "top_p")):
        with pytest.raises(ValueError) as e:
            engine.submit([1, 2], s, lambda ev: None)
        assert e.value.param == param
