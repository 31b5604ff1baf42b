"""Every environment flag is read through `opweave.config`; "0"/"false"/"no"/"off" mean off."""

import pathlib
import re

import pytest

from opweave import config
from opweave.errors import OpWeaveError

ROOT = pathlib.Path(__file__).resolve().parents[1] / "opweave"


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), ("0", False), ("", False), ("false", False),
                                      ("No", False), ("off", False), (" 0 ", False)])
def test_boolean_flags_parse_off_values(monkeypatch, value, on):
    for name, read in (("OPWEAVE_DEBUG", config.debug_enabled), ("OPWEAVE_VERIFY", config.verify_enabled),
                       ("TRITON_INTERPRET", config.triton_interpret)):
        monkeypatch.setenv(name, value)
        assert read() is on, (name, value)


def test_unset_flags_are_off(monkeypatch):
    for name in ("OPWEAVE_DEBUG", "OPWEAVE_VERIFY", "OPWEAVE_KERNELS", "OPWEAVE_FAULT_KILL", "OPWEAVE_FAULT_STALL"):
        monkeypatch.delenv(name, raising=False)
    assert not config.debug_enabled() and not config.verify_enabled()
    assert config.kernels_forced() is None and config.fault_injection(0) == {}


def test_kernel_backend_is_validated(monkeypatch):
    monkeypatch.setenv("OPWEAVE_KERNELS", "Triton")
    assert config.kernels_forced() == "triton"
    monkeypatch.setenv("OPWEAVE_KERNELS", "cuda")
    with pytest.raises(OpWeaveError, match="OPWEAVE_KERNELS"):
        config.kernels_forced()


def test_fault_injection_targets_one_rank(monkeypatch):
    monkeypatch.setenv("OPWEAVE_FAULT_KILL", "1:3")
    monkeypatch.setenv("OPWEAVE_FAULT_STALL", "0")
    assert config.fault_injection(1) == {"kill": 3}
    assert config.fault_injection(0) == {"stall": 0}
    monkeypatch.setenv("OPWEAVE_FAULT_KILL", "one:3")
    with pytest.raises(OpWeaveError, match="RANK:ROUND"):
        config.fault_injection(1)


def test_no_module_reads_opweave_flags_directly():
    """Only config.py reads OPWEAVE_* / TRITON_INTERPRET from the environment."""
    pattern = re.compile(r"(environ|getenv)[^\n]*(OPWEAVE_|TRITON_INTERPRET)")
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if p.name != "config.py" and pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
