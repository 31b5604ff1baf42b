"""The bytes of one transfer between two ranks: one message per peer per stage boundary.

Layout: width (int64: tokens per row this round, 1 in decode), positions [rows, width] (int64),
then each value [rows, width, *shape] in packing order, all as bytes. A receiver posts a
decode-sized (width 1) receive; a wider message (a prefill) is preceded by a decode-sized one
that carries only its width. The profiler times `pack_message` and `unpack_message` with the
transport (`opweave.profile.comm`) as the host cost of each side of a transfer.
"""

from __future__ import annotations

import torch


def message_bytes(rows: int, width: int, per_token: int) -> int:
    """A transfer's message: its width (int64), positions (int64) and `per_token` bytes of values per token."""
    return 8 + rows * width * (8 + per_token)


def pack_message(width: int, positions: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """One transfer to one peer as bytes: the width, positions [rows, width], then each value;
    on the positions' device (a rank's run device: NCCL sends only device tensors)."""
    device = positions.device
    parts = [torch.tensor([width], dtype=torch.long, device=device).view(torch.uint8),
             positions.contiguous().view(torch.uint8).reshape(-1)]
    parts += [v.to(device).contiguous().view(torch.uint8).reshape(-1) for v in values]
    return torch.cat(parts)


def width_message(message: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The decode-sized message that goes before a wider one (a prefill of `width` tokens per
    row): its width, then zeros up to the size of a width-1 message of the same values."""
    per_token = (message.numel() - message_bytes(rows, width, 0)) // (rows * width)
    return torch.cat([message[:8], message.new_zeros(message_bytes(rows, 1, per_token) - 8)])


def message_width(message: torch.Tensor) -> int:
    return int(message[:8].view(torch.long))


def unpack_message(message: torch.Tensor, rows: int, width: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [rows, width], the values' elements in packing order) of a packed message (views)."""
    end = 8 + rows * width * 8
    return message[8:end].view(torch.long).view(rows, width), message[end:].view(dtype)
