"""`NoHostSync`: the check, run on CPU, that a decode round never synchronises with the host
(so it can be captured in a CUDA graph). Every plan of every family runs its decode rounds under
it in tests/test_runtime.py (`OPWEAVE_CHECK_SYNC=1`); here, that it catches each kind of sync."""

import pytest
import torch

from opweave.runtime.syncguard import HostSyncError, NoHostSync

T = torch.arange(6)

SYNCS = {
    "item": lambda: T[0].item(),
    "int": lambda: int(T[1]),
    "bool": lambda: bool(T[1] > 0),
    "float": lambda: float(T[2]),
    "tolist": lambda: T.tolist(),
    "numpy": lambda: T.numpy(),
    "torch.tensor": lambda: torch.tensor([1, 2]),
    "nonzero": lambda: T.nonzero(),
    "masked assignment of a scalar": lambda: T.clone().__setitem__(T > 2, 5),
    "boolean mask": lambda: T[T > 2],
    "torch.equal": lambda: torch.equal(T, T),
    "copy to another device": lambda: T.to("meta"),
    "copy_ from another device": lambda: torch.empty(6, dtype=torch.long, device="meta").copy_(T),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_kind_of_host_sync_is_caught(name):
    with pytest.raises(HostSyncError, match="synchronises with the host"):
        with NoHostSync():
            SYNCS[name]()
    assert T.tolist() == [0, 1, 2, 3, 4, 5]  # the patched methods are restored


def test_device_side_work_passes():
    x, pos = torch.randn(4, 8), torch.tensor([[3], [-1], [0], [7]])
    with NoHostSync() as guard:
        pos.add_(pos.ge(0).to(pos.dtype))
        y = torch.where(pos >= 0, x.softmax(-1).argmax(-1, keepdim=True), -1)
        z = torch.zeros(4, 8).index_add_(0, torch.arange(4), x)  # a factory op with no host data
        buf = torch.empty(4, dtype=torch.long)
        buf.copy_(y.view(-1))  # same device
    assert guard.ops > 5 and pos.view(-1).tolist() == [4, -1, 1, 8] and z.shape == (4, 8)
