"""Transparent huge pages under a CPU rank's weights and KV pool.

A decode round streams every weight once (hundreds of MB for a small model): with 4 KiB pages
that is a TLB miss every 4 KiB, and a decode GEMM on one core is bound by that stream. Backing the
memory with 2 MiB pages makes oneDNN's packed decode GEMMs about 8% faster (16 rows, one thread;
`bench/results/hugepages.md`), as llama.cpp and most CPU inference servers arrange it.

Linux hands huge pages to anonymous memory at fault time only where the process asked
(`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most distributions), and the
weights are already in place when a rank could ask. So after the rank has loaded and packed its
weights and allocated its pool, `back_with_huge_pages` asks for the memory it already holds: for
each whole huge page of a private, writable, anonymous mapping that is resident (`MIN_RESIDENT`
of its base pages, by `mincore`: reserved-but-untouched memory is not made resident),
`madvise(MADV_HUGEPAGE)` then `madvise(MADV_COLLAPSE)` (Linux 6.1+: collapse now, not whenever
khugepaged gets to it).

It is a best effort and changes no value: where the kernel refuses (no MADV_COLLAPSE, THP `never`,
no contiguous 2 MiB frames free) the memory stays as it was. OPWEAVE_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import sys

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
MIN_RESIDENT = 0.95  # share of a huge page's base pages resident before it is collapsed (that fills the holes)


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One mapping of /proc/self/smaps, as far as collapsing it goes."""

    start: int
    end: int
    perms: str
    path: str
    rss: int           # bytes resident
    anon_huge: int     # bytes already in huge pages

    @property
    def aligned(self) -> tuple[int, int]:
        """The whole huge pages inside the mapping: [start, end), empty when none."""
        start = (self.start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        end = self.end // HUGE_PAGE * HUGE_PAGE
        return start, max(start, end)

    @property
    def candidate(self) -> bool:
        """Private, writable, anonymous (or the brk heap), holding a whole huge page not yet huge
        and at least one huge page's worth resident (which huge pages are resident enough is
        `resident_runs`'s)."""
        start, end = self.aligned
        return (self.perms.startswith("rw") and self.perms[3:4] == "p" and self.path in ("", "[heap]")
                and end - start >= HUGE_PAGE and self.rss >= HUGE_PAGE and self.anon_huge < end - start)


def resident_runs(start: int, resident: bytes | bytearray, page: int) -> list[tuple[int, int]]:
    """The runs [start, end) of whole huge pages from `start` (huge-page aligned) at least
    `MIN_RESIDENT` resident, given one byte per base page of `page` bytes whose low bit says the
    page is resident (mincore's answer)."""
    per = HUGE_PAGE // page
    runs: list[tuple[int, int]] = []
    for k in range(len(resident) // per):
        chunk = resident[k * per:(k + 1) * per]
        if sum(b & 1 for b in chunk) < MIN_RESIDENT * per:
            continue
        lo = start + k * HUGE_PAGE
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], lo + HUGE_PAGE)
        else:
            runs.append((lo, lo + HUGE_PAGE))
    return runs


def parse_smaps(text: str) -> list[Mapping]:
    """The mappings of an smaps file's text (header lines `start-end perms offset dev inode [path]`,
    then `Key: value kB` lines)."""
    out: list[Mapping] = []
    head: list[str] | None = None
    fields: dict[str, int] = {}

    def flush():
        if head is not None:
            start, end = (int(x, 16) for x in head[0].split("-"))
            out.append(Mapping(start, end, head[1], head[5] if len(head) > 5 else "",
                               fields.get("Rss", 0) * 1024, fields.get("AnonHugePages", 0) * 1024))

    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if "-" in parts[0] and not parts[0].endswith(":"):
            flush()
            head, fields = parts, {}
        elif parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
            fields[parts[0][:-1]] = int(parts[1])
    flush()
    return out


@dataclasses.dataclass
class Collapsed:
    """What `back_with_huge_pages` did: bytes asked for, bytes the kernel collapsed, and why none
    (None: it ran)."""

    asked: int = 0
    collapsed: int = 0
    skipped: str | None = None


def back_with_huge_pages() -> Collapsed:
    """Collapses this process's resident anonymous memory into huge pages (see the module)."""
    from opweave import config

    if not config.huge_pages_enabled():
        return Collapsed(skipped="off (OPWEAVE_HUGE_PAGES=0)")
    if not sys.platform.startswith("linux"):
        return Collapsed(skipped="not Linux")
    try:
        with open("/proc/self/smaps") as f:
            maps = parse_smaps(f.read())
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError as e:
        return Collapsed(skipped=f"{type(e).__name__}: {e}")
    madvise, mincore = libc.madvise, libc.mincore
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    madvise.restype = mincore.restype = ctypes.c_int
    page = os.sysconf("SC_PAGE_SIZE")
    done = Collapsed()
    for m in maps:
        if not m.candidate:
            continue
        start, end = m.aligned
        vec = (ctypes.c_ubyte * ((end - start) // page))()
        if mincore(start, end - start, vec) != 0:
            continue
        for lo, hi in resident_runs(start, bytes(vec), page):
            done.asked += hi - lo
            if madvise(lo, hi - lo, MADV_HUGEPAGE) == 0 and madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
                done.collapsed += hi - lo
    return done


def anon_huge_bytes() -> int:
    """Bytes of this process's anonymous memory in huge pages now (0 where unknown)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
