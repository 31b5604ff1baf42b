"""The bytes of one transfer between two ranks: one message per peer per stage boundary.

Layout: each row's sampling word [rows, WORD] (int64, `opweave.kernels.sampling`: it travels with
the row to the last stage), the packed tokens' positions [1, tokens] (int64), then each value
[1, tokens, *shape] in packing order, all as bytes: the message's rows' tokens only, no padding
(`opweave.runtime.layout`). The tokens of every message of a round are known to both ends before
the round (the scheduler plans them ahead and every rank agrees on them between rounds,
`Transport.complete_round`), so a receiver posts a receive of the right size and reads nothing on
the host. The profiler times `pack_message` and `unpack_message` with the transport
(`opweave.profile.comm`) as the host cost of each side of a transfer.
"""

from __future__ import annotations

import torch

from opweave.kernels.sampling import WORD

WORD_BYTES = 8 * WORD  # a row's sampling word: `WORD` int64s (`opweave.kernels.sampling.FIELDS`)


def message_bytes(rows: int, tokens: int, per_token: int) -> int:
    """A transfer's message: each row's sampling word, then positions (int64) and `per_token`
    bytes of values per token, for `tokens` tokens in all."""
    return rows * WORD_BYTES + tokens * (8 + per_token)


def pack_message(positions: torch.Tensor, word: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """One transfer to one peer as bytes: the rows' sampling words [rows, WORD], positions
    [1, tokens], then each value; on the positions' device (a rank's run device: NCCL sends
    only device tensors)."""
    device = positions.device
    parts = [word.to(device).contiguous().view(torch.uint8).reshape(-1),
             positions.contiguous().view(torch.uint8).reshape(-1)]
    parts += [v.to(device).contiguous().view(torch.uint8).reshape(-1) for v in values]
    return torch.cat(parts)


def unpack_message(message: torch.Tensor, rows: int, tokens: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions [1, tokens], sampling words [rows, WORD], the values' elements in packing order)
    of a packed message (views)."""
    head = rows * WORD_BYTES
    end = head + tokens * 8
    word = message[:head].view(torch.long).view(rows, WORD)
    return message[head:end].view(torch.long).view(1, tokens), word, message[end:].view(dtype)
