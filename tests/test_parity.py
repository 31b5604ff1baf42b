"""Numerical parity with Hugging Face transformers on tiny random-weight checkpoints.

Each family's checkpoint is saved with transformers' `save_pretrained` and loaded by OpWeave from
its safetensors; the prompt (longer than Gemma's sliding window of 8) is prefilled in one forward,
then 8 greedy decode steps run through the KV cache / recurrent state.
"""

import pytest
import torch

from hf_fixtures import hf_generate, hf_step_logits
from opweave.models.model import generate
from opweave.models.registry import resolve

PROMPT = [(7 * i + 3) % 100 for i in range(20)]
NEW_TOKENS = 8
ATOL = 1e-4


@pytest.mark.parametrize("family,layers", [("llama", 3), ("gemma3", 8), ("gemma3", 7), ("qwen3_moe", 3)])
@pytest.mark.slow
def test_logits_and_tokens_match_transformers(tiny_checkpoint, family, layers):
    folder = tiny_checkpoint(family, num_hidden_layers=layers)
    model = resolve(folder).load()
    assert model.cfg.num_layers == layers
    logits, tokens = generate(model, PROMPT, NEW_TOKENS)

    ref_prompt_logits, ref_tokens = hf_generate(folder, PROMPT, NEW_TOKENS)
    ref_step_logits = hf_step_logits(folder, PROMPT, NEW_TOKENS)

    torch.testing.assert_close(logits[: len(PROMPT)], ref_prompt_logits, atol=ATOL, rtol=0)
    # decode-step logits: row 0 is the prompt's last position, then one row per decode step
    n = min(len(ref_step_logits), NEW_TOKENS)
    torch.testing.assert_close(logits[len(PROMPT) - 1: len(PROMPT) - 1 + n], ref_step_logits[:n], atol=ATOL, rtol=0)
    assert tokens == ref_tokens
    assert len(set(tokens)) > 1, "degenerate fixture: greedy decoding repeats one token"


def test_padded_batch_matches_single_sequences(tiny_checkpoint):
    """Two prompts of different lengths in one batch (padding at position -1) decode as if alone."""
    model = resolve(tiny_checkpoint("gemma3", num_hidden_layers=8)).load()
    short = PROMPT[:11]
    _, alone_long = generate(model, PROMPT, 4)
    _, alone_short = generate(model, short, 4)

    model.allocate_state(2, len(PROMPT) + 4)
    ids = torch.tensor([PROMPT, short + [0] * (len(PROMPT) - len(short))])
    pos = torch.arange(len(PROMPT)).repeat(2, 1)
    pos[1, len(short):] = -1
    logits = model(ids, pos)
    nxt = torch.stack([logits[0, len(PROMPT) - 1].argmax(), logits[1, len(short) - 1].argmax()])
    got = [[int(nxt[0])], [int(nxt[1])]]
    lengths = torch.tensor([len(PROMPT), len(short)])
    with torch.no_grad():
        for step in range(3):
            logits = model(nxt[:, None], (lengths + step)[:, None])
            nxt = logits[:, -1].argmax(-1)
            got[0].append(int(nxt[0]))
            got[1].append(int(nxt[1]))
    assert got == [alone_long, alone_short]
