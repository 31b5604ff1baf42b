"""Huge pages under a CPU rank's memory (`opweave.runtime.hugepages`): which mappings are
collapsed, that collapsing changes no value, and the switch."""

from __future__ import annotations

import mmap
import os
import platform

import numpy as np
import pytest
import torch

from opweave.runtime import hugepages as hp

MB = 1 << 20

SMAPS = """\
7f0000000000-7f0004000000 rw-p 00000000 00:00 0 
Size:              65536 kB
Rss:               65536 kB
AnonHugePages:         0 kB
7f0004000000-7f0008000000 rw-p 00000000 00:00 0 
Size:              65536 kB
Rss:                4096 kB
AnonHugePages:         0 kB
7f0008000000-7f000c000000 rw-s 00000000 00:01 1234                       /dev/zero (deleted)
Size:              65536 kB
Rss:               65536 kB
AnonHugePages:         0 kB
7f000c000000-7f0010000000 r--p 00000000 08:01 99                         /usr/lib/libfoo.so
Size:              65536 kB
Rss:               65536 kB
AnonHugePages:         0 kB
7f0010000000-7f0014000000 rw-p 00000000 00:00 0 
Size:              65536 kB
Rss:               65536 kB
AnonHugePages:     65536 kB
7f0014000000-7f0014100000 rw-p 00000000 00:00 0 
Size:               1024 kB
Rss:                1024 kB
AnonHugePages:         0 kB
55d000000000-55d000a00000 rw-p 00000000 00:00 0                          [heap]
Size:              10240 kB
Rss:               10240 kB
VmFlags: rd wr mr mw me ac sd 
"""


def test_parse_and_candidates():
    maps = hp.parse_smaps(SMAPS)
    assert [(m.start, m.end, m.path) for m in maps][:2] == [(0x7F0000000000, 0x7F0004000000, ""),
                                                            (0x7F0004000000, 0x7F0008000000, "")]
    assert maps[2].path == "/dev/zero" and maps[3].path == "/usr/lib/libfoo.so"
    assert maps[0].rss == 64 * MB and maps[4].anon_huge == 64 * MB
    # private anonymous memory and the heap are looked at; shared, file-backed, already huge and
    # smaller-than-a-huge-page mappings, and those with less than a huge page resident, are not
    assert [m.candidate for m in maps] == [True, True, False, False, False, False, True]
    tiny_rss = hp.Mapping(start=0, end=64 * MB, perms="rw-p", path="", rss=1 * MB, anon_huge=0)
    assert not tiny_rss.candidate


def test_resident_runs():
    per = hp.HUGE_PAGE // 4096
    full, empty = b"\x01" * per, b"\x00" * per
    almost = b"\x01" * (per - per // 100) + b"\x00" * (per // 100)  # 99% resident
    half = b"\x01" * (per // 2) + b"\x00" * (per // 2)
    base = 16 * hp.HUGE_PAGE
    runs = hp.resident_runs(base, full + almost + half + empty + full + b"\x01" * 7, 4096)
    assert runs == [(base, base + 2 * hp.HUGE_PAGE), (base + 4 * hp.HUGE_PAGE, base + 5 * hp.HUGE_PAGE)]
    assert hp.resident_runs(base, b"\x03" * per, 4096) == [(base, base + hp.HUGE_PAGE)]  # low bit only


def test_aligned_range_is_whole_huge_pages():
    m = hp.Mapping(start=hp.HUGE_PAGE + 4096, end=4 * hp.HUGE_PAGE + 8192, perms="rw-p", path="", rss=1 << 40,
                   anon_huge=0)
    assert m.aligned == (2 * hp.HUGE_PAGE, 4 * hp.HUGE_PAGE)
    tiny = hp.Mapping(start=hp.HUGE_PAGE + 4096, end=2 * hp.HUGE_PAGE + 4096, perms="rw-p", path="", rss=1 << 40,
                      anon_huge=0)
    assert tiny.aligned[1] - tiny.aligned[0] == 0 and not tiny.candidate


def test_switched_off(monkeypatch):
    monkeypatch.setenv("OPWEAVE_HUGE_PAGES", "0")
    done = hp.back_with_huge_pages()
    assert done.skipped == "off (OPWEAVE_HUGE_PAGES=0)" and done.asked == 0


def _collapse_supported() -> str | None:
    if not platform.system() == "Linux":
        return "not Linux"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return "transparent huge pages are off on this machine"
    except OSError:
        return "no transparent huge pages"
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) < (6, 1):
        return "MADV_COLLAPSE needs Linux 6.1"
    return None


@pytest.mark.skipif(_collapse_supported() is not None, reason=str(_collapse_supported()))
def test_collapses_resident_memory_and_keeps_values(monkeypatch):
    monkeypatch.delenv("OPWEAVE_HUGE_PAGES", raising=False)
    region = mmap.mmap(-1, 64 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    sparse = mmap.mmap(-1, 64 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    weights = torch.from_numpy(np.frombuffer(region, dtype=np.float32))
    weights.copy_(torch.randn(weights.numel(), generator=torch.Generator().manual_seed(0)))
    expected = weights.clone()
    sparse[:4096] = b"x" * 4096  # one page of 16384 resident: not collapsed (that would make it all resident)
    base = np.frombuffer(region, dtype=np.uint8).ctypes.data
    sparse_base = np.frombuffer(sparse, dtype=np.uint8).ctypes.data
    before = hp.anon_huge_bytes()
    done = hp.back_with_huge_pages()
    assert done.skipped is None and done.collapsed > 0
    assert hp.anon_huge_bytes() >= before + 60 * MB  # the region's whole huge pages, at least
    with open(f"/proc/{os.getpid()}/smaps") as f:
        maps = hp.parse_smaps(f.read())
    mine = [m for m in maps if m.start <= base < m.end]
    assert mine and mine[0].anon_huge >= 60 * MB
    theirs = [m for m in maps if m.start <= sparse_base < m.end]
    assert theirs and theirs[0].rss < 8 * MB  # left sparse
    assert torch.equal(weights, expected)
    del weights
    # the mappings go with the last references to them (numpy and torch hold exported buffers)
