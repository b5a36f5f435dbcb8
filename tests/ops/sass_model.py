"""A per-row timing model read off a kernel's SASS (sm_90a, sm_100a): every instruction one warp issues for a row,
the pipes they load, and a timeline of one warp through the row that waits where the SASS waits.

The SASS comes from nvdisasm (tests/ops/hopper_aot.py's `disassemble`), or from `cuobjdump -sass`-style text
(`parse_sass`: the hand-written snippets of the tests). Each instruction carries its control bits (the top 23 bits
of its 128-bit encoding, cuobjdump's second hex word): the stall count, the scoreboard (SB) a variable-latency
instruction sets on completion, and the mask of SBs the instruction waits for before it issues. A global load
(LDG) sets an SB that its first consumer waits on; the pipelined tile copies (LDGSTS, `cp.async`) are committed in
groups (LDGDEPBAR) and awaited with `DEPBAR.LE SB0, n` (at most n groups still outstanding). So the SASS itself
states where each load is issued and where it is awaited.

The walk (`walk_rows`): the kernels are persistent, one loop over rows i, i + grid, ...; the model follows one
warp through the program's setup and then `rows` iterations of that row loop. Control flow:
- a tile loop (an innermost loop) runs its given number of trips; its first trip runs every forward branch's
  fall-through (the target's tile, a HEAD row's first tile: code run once per row), later trips take them (the
  common path); a forward branch out of the loop (a rotated loop's exit test) is taken on the last trip;
- outside the tile loops a conditional forward branch falls through (the live row, a guard that skips an empty
  loop), unless its fall-through path ends in a jump over a tile loop (a dead row's path laid out first); an
  unconditional one is followed, and so is a conditional one whose fall-through calls a routine (the slow path of
  an emulated operation: a 64-bit division whose operands fit 32 bits takes the inline 32-bit one); an innermost
  loop that is not a tile loop runs once; a call left on the path is an error (its callee would go uncounted).

The timeline (`simulate`): one warp issues its instructions in order, each taking max(stall, share) cycles, where
`share` is the warps of its CTA per SM sub-partition (4 issue slots per SM: the CTA's own warps take turns);
before an instruction it waits for its SBs; `DEPBAR.LE` waits for the oldest committed copy groups; a `BAR.SYNC`
costs BARRIER cycles (the CTA's warps are symmetric: each arrives as late as this one), a cluster barrier's wait
CLUSTER_WAIT. Latencies: global loads by their class (DRAM, or the L2 hit/miss mix of a row re-read), the short
variable-latency units by SHORT_LATENCY.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]+)\s*\*/")
_HI = re.compile(r"^\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
# A branch: predicated by a guard (@P0 BRA) or, on sm_100, by a uniform predicate operand (BRA.U !UP1, 0x...).
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(!?U?P\d+,\s*)?(?:`\()?0x([0-9a-f]+)")
_DEPBAR = re.compile(r"\bDEPBAR\.LE\s+SB0,\s*(0x[0-9a-f]+|\d+)")
# Latencies in cycles of the variable-latency units other than global memory (pessimistic round figures for
# sm_90: MUFU ~ 20, shared-memory loads and shuffles ~ 30, special registers and conversions ~ 25).
SHORT_LATENCY = {"MUFU": 24, "LDS": 32, "SHFL": 32, "S2R": 25, "S2UR": 25}
DEFAULT_SHORT = 24  # any other SB-setting unit (LDC, conversions, FP64, REDUX, ...)
BARRIER = 32  # cycles a BAR.SYNC costs when every warp of the CTA arrives together
# cycles a cluster barrier's wait (UCGABAR_WAIT: a row split across the CTAs of a cluster, `num_ctas`) costs with
# the fence before it: an assumption for pricing that split (tests/ops/test_performance_model.py), no measured figure
CLUSTER_WAIT = 400
# Pipes: warp instructions per cycle per SM (sm_90: 16 MUFU lanes, 64 INT32/ALU lanes, 4 schedulers)
MUFU_PER_CLK = 16 / 32
ALU_PER_CLK = 64 / 32
ISSUE_PER_CLK = 4
_ALU = re.compile(
    r"^(?:@!?U?P\w+\s+)?(LOP3|LOP|SHF|SHL|SHR|IADD3|ISETP|FSETP|DSETP|FMNMX|IMNMX|VIMNMX|FSEL|SEL|PRMT|LEA|PLOP3|"
    r"P2R|R2P|FLO|POPC|BMSK|SGXT|VIADD|VIMNMX3|I2IP|F2FP|FCHK|CSET|CSETP|ISCADD)\b"
)


@dataclass(frozen=True)
class Instr:
    addr: int
    text: str
    ctrl: int  # bits 105..127 of the encoding

    @property
    def stall(self) -> int:
        return self.ctrl & 0xF

    @cached_property
    def sets_sb(self) -> int | None:  # the scoreboard set on completion (7: none)
        sb = (self.ctrl >> 5) & 7
        return None if sb == 7 else sb

    @cached_property
    def waits(self) -> list[int]:
        mask = (self.ctrl >> 11) & 0x3F
        return [b for b in range(6) if mask >> b & 1]

    @cached_property
    def op(self) -> str:
        return re.sub(r"^@!?U?P\w+\s+", "", self.text).split(" ", 1)[0]

    @cached_property
    def predicated(self) -> bool:
        """Conditional: a guard predicate, or a branch's predicate operand."""
        m = _BRANCH.match(self.text)
        return self.text.startswith("@") or bool(m and m.group(2))

    @cached_property
    def target(self) -> int | None:
        """A branch's target address (None: not a branch)."""
        m = _BRANCH.match(self.text)
        return int(m.group(3), 16) if m else None


def parse_sass(sass: str) -> list[Instr]:
    """Instructions of the (single) function in `cuobjdump -sass`-style text, with their control bits."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _INSTR.match(line)
        if m and i + 1 < len(lines) and (hi := _HI.match(lines[i + 1])):
            out.append(Instr(int(m.group(1), 16), m.group(2), int(hi.group(1), 16) >> 41))
    return out


def compact(code: list[Instr]) -> list[list]:
    return [[c.addr, c.text, c.ctrl] for c in code]


def expand(rows: list[list]) -> list[Instr]:
    return [Instr(a, t, c) for a, t, c in rows]


def _loops(code: list[Instr]) -> list[tuple[int, int]]:
    """(head index, back-branch index) of every backward branch (self loops, the trap after EXIT, excluded)."""
    index = {c.addr: i for i, c in enumerate(code)}
    out = []
    for i, c in enumerate(code):
        t = c.target
        if t is not None and t < c.addr and t in index:
            out.append((index[t], i))
    return out


@dataclass
class Structure:
    row_head: int  # index of the row loop's first instruction
    row_back: int  # index of its back branch
    inner: list[tuple[int, int]]  # innermost loops (head, back), in program order
    tile_loops: list[tuple[int, int]]  # the innermost loops holding MUFU.EX2, in program order
    tile_loop_at: list[tuple[int, int] | None]  # per instruction: the tile loop holding it, if any


def structure(code: list[Instr]) -> Structure:
    loops = _loops(code)
    inner = sorted({(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)})
    tiles = [(a, b) for a, b in inner if any(code[i].op == "MUFU.EX2" for i in range(a, b + 1))]
    outer = [(a, b) for a, b in loops if tiles and a <= tiles[0][0] and tiles[-1][1] <= b]
    if not outer:
        raise ValueError("no row loop around the tile loops")
    head, back = max(outer, key=lambda ab: ab[1] - ab[0])
    loop_at: list[tuple[int, int] | None] = [None] * len(code)
    for a, b in tiles:
        loop_at[a : b + 1] = [(a, b)] * (b + 1 - a)
    return Structure(head, back, inner, tiles, loop_at)


def _walk(code: list[Instr], start: int, stop: int, trips: dict[tuple[int, int], int], index: dict[int, int],
          inner: dict[int, int], tiles: set[int]) -> Iterator[tuple[int, int]]:  # fmt: skip
    """(index, trip of its innermost loop or -1) issued from `start` up to (excluding) `stop` on the path of the
    module docstring."""
    i = start
    while start <= i < stop:
        if i in inner:
            back = inner[i]
            n = trips.get((i, back), 1)
            nxt = back + 1
            for trip in range(n):
                j = i
                while j <= back:
                    yield j, trip
                    t = code[j].target
                    if t is not None and j < back and t > code[j].addr:
                        k = index[t]
                        if k > back:  # leaves the loop
                            if trip == n - 1:
                                nxt = k
                                break
                        elif trip > 0 or not code[j].predicated:
                            j = k
                            continue
                    j += 1
                else:
                    continue
                break
            i = nxt
            continue
        yield i, -1
        c = code[i]
        if c.op == "EXIT" and not c.predicated:
            return
        t = c.target
        if (
            t is not None
            and t > c.addr
            and (not c.predicated or _skips_tiles(code, i, index[t], index, tiles) or _calls(code, i, index[t]))
        ):
            i = index[t]
            continue
        i += 1


def _calls(code: list[Instr], i: int, k: int) -> bool:
    """Whether falling through the conditional branch at `i` (to `k`) calls a routine: the slow path of an
    emulated operation, laid out first, that the branch skips when its operands allow the inline one (a 64-bit
    division whose operands fit 32 bits, as every row index and length here does, takes the 32-bit divide)."""
    return any(code[j].op.startswith("CALL") for j in range(i + 1, k))


def _skips_tiles(code: list[Instr], i: int, k: int, index: dict[int, int], tiles: set[int]) -> bool:
    """Whether falling through the conditional branch at `i` (to `k`) ends in an unconditional jump over a tile
    loop: then the branch leads to the live row (a compiler may lay the dead row's path first)."""
    for j in range(i + 1, k):
        t = code[j].target
        if t is not None and not code[j].predicated and any(k <= h < index[t] for h in tiles):
            return True
    return False


def walk_rows(code: list[Instr], tile_trips: list[int], rows: int) -> tuple[list[int], list[int], set[int]]:
    """(instruction indices in issue order, the position in that list where each row starts, the positions of
    tile copies predicated off): the setup before the row loop, then `rows` trips of the row loop. `tile_trips`:
    trips of each tile loop, in program order. A copy is off when its tile is past the loop's last: in trip t of a
    loop that waits with `DEPBAR.LE SB0, k` it loads tile t + k + 1; before the loop, copy group g loads tile g."""
    st = structure(code)
    if len(tile_trips) != len(st.tile_loops):
        raise ValueError(f"{len(st.tile_loops)} tile loops in the SASS, {len(tile_trips)} trip counts given")
    trips = dict(zip(st.tile_loops, tile_trips, strict=True))
    index = {c.addr: i for i, c in enumerate(code)}
    inner = dict(st.inner)
    heads = {a for a, _ in st.tile_loops}
    walked = list(_walk(code, 0, st.row_head, trips, index, inner, heads))
    starts = []
    for _ in range(rows):
        starts.append(len(walked))
        walked += list(_walk(code, st.row_head, st.row_back, trips, index, inner, heads))
        walked.append((st.row_back, -1))
    seq = [i for i, _ in walked]
    calls = [code[i].text for i in seq if code[i].op.startswith("CALL")]
    if calls:  # the callee's instructions would go uncounted (a 64-bit division, say): the model would flatter
        raise ValueError(f"a call on the walked path, whose callee the walk does not enter: {calls[:3]}")
    missed = [lp for lp, n in trips.items() if n and lp[0] not in set(seq)]
    if missed:
        raise ValueError(f"tile loops off the walked path: {missed}")
    outstanding = {}
    for a, b in st.tile_loops:
        waits = [m for j in range(a, b + 1) if (m := _DEPBAR.search(code[j].text))]
        outstanding[(a, b)] = int(waits[0].group(1), 0) if waits else 0
    copy = [c.op.startswith("LDGSTS") for c in code]
    commit = [c.op == "LDGDEPBAR" for c in code]
    off, group = set(), 0
    for pos, (i, trip) in enumerate(walked):
        loop = st.tile_loop_at[i]
        if loop is not None:
            group = 0
            if copy[i] and trip + outstanding[loop] + 1 >= trips[loop]:
                off.add(pos)
        elif commit[i]:
            group += 1
        elif copy[i]:
            following = [lp for lp in st.tile_loops if lp[0] > i]
            if following and group >= trips[following[0]]:
                off.add(pos)
    return seq, starts, off


def is_global_load(c: Instr) -> bool:
    return c.op.startswith("LDG") and not c.op.startswith(("LDGSTS", "LDGDEPBAR"))


def simulate(code: list[Instr], seq: list[int], share: int, load_latency: Callable[[int], float],
             off: set[int] = frozenset()) -> list[float]:  # fmt: skip
    """Issue time (cycles) of each entry of `seq` for one warp (module docstring); the last entry is the end.
    `load_latency(index)`: the latency of the global load or tile copy at that instruction; `off`: positions in
    `seq` of copies predicated off (they complete at once)."""
    # Each instruction's part, read once: (SBs waited on, copy groups a DEPBAR.LE leaves outstanding or -1, fixed
    # wait (barrier), kind (1 copy, 2 commit, 3 sets an SB), SB set, fixed latency or None for a global load, step)
    static = []
    for c in code:
        op = c.op
        m = _DEPBAR.search(c.text) if op == "DEPBAR.LE" else None
        if op.startswith("BAR.SYNC") or op.startswith("BAR.RED") or op == "BAR":
            fixed = BARRIER
        else:
            fixed = CLUSTER_WAIT if op.startswith("UCGABAR_WAIT") else 0
        kind, sb, short = 0, c.sets_sb, None
        if op.startswith("LDGSTS"):
            kind = 1
        elif op == "LDGDEPBAR":
            kind = 2
        elif sb is not None:
            kind = 3
            short = None if is_global_load(c) else SHORT_LATENCY.get(op.split(".")[0], DEFAULT_SHORT)
        static.append((c.waits, int(m.group(1), 0) if m else -1, fixed, kind, sb, short, max(c.stall, share)))
    ready = [0.0] * 6
    groups: list[float] = []  # completion of each committed copy group, in commit order
    open_group = 0.0
    t = 0.0
    times = []
    for pos, i in enumerate(seq):
        waits, depbar, fixed, kind, sb, short, step = static[i]
        for b in waits:
            if ready[b] > t:
                t = ready[b]
        if depbar >= 0 and len(groups) > depbar:
            t = max(t, groups[len(groups) - depbar - 1])
        t += fixed
        times.append(t)
        if kind == 1:
            open_group = max(open_group, t if pos in off else t + load_latency(i))
        elif kind == 2:
            groups.append(max(open_group, groups[-1] if groups else 0.0))
            open_group = 0.0
        elif kind == 3:
            ready[sb] = max(ready[sb], t + (load_latency(i) if short is None else short))
        t += step
    times.append(t)
    return times


def pipe_counts(code: list[Instr], seq: list[int]) -> dict[str, int]:
    """Warp instructions of `seq`, all and per pipe that can bind before issue does (MUFU, ALU)."""
    out = {"issue": len(seq), "mufu": 0, "alu": 0, "ex2": 0, "bar": 0, "shfl": 0, "ldg": 0}
    for i, n in Counter(seq).items():
        c = code[i]
        out["mufu"] += n * c.op.startswith("MUFU")
        out["ex2"] += n * (c.op == "MUFU.EX2")
        out["alu"] += n * bool(_ALU.match(c.text))
        out["bar"] += n * c.op.startswith("BAR")
        out["shfl"] += n * c.op.startswith("SHFL")
        out["ldg"] += n * is_global_load(c)
    return out


def pipelined_lead(code: list[Instr], loop: tuple[int, int]) -> float | None:
    """Tiles between a pipelined loop's copy issue and its wait: the loop waits with `DEPBAR.LE SB0, k` (k groups
    still outstanding) and issues the next tile's copies a fraction f of its common path later, so a copy issued
    in trip i is awaited k + 1 trips on: lead = k + 1 − f. None for a loop without copies."""
    a, b = loop
    body = list(range(a, b + 1))
    common = []
    j = a
    while j <= b:  # the common path (forward branches inside taken)
        common.append(j)
        t = code[j].target
        if t is not None and j < b and t > code[j].addr and t <= code[b].addr:
            j = next(k for k in body if code[k].addr == t)
            continue
        j += 1
    waits = [p for p, j in enumerate(common) if code[j].op == "DEPBAR.LE"]
    copies = [p for p, j in enumerate(common) if code[j].op.startswith("LDGSTS")]
    if not waits or not copies:
        return None
    m = _DEPBAR.search(code[common[waits[0]]].text)
    k = int(m.group(1), 0) if m else 0
    f = ((copies[0] - waits[0]) % len(common)) / len(common)
    return k + 1 - f


def row_regions(code: list[Instr], loops: list[tuple[int, int]], seq: list[int], times: list[float], start: int,
                end: int, share: int) -> dict[str, dict[str, float]]:  # fmt: skip
    """Where the cycles of one walked row (positions start..end of `seq`, timed by `simulate`) go, by region: the
    row's code before its first tile loop ("setup"), each tile loop ("pass 1", "pass 2"; "tiles" for a one-pass
    kernel), the code between them ("between") and after the last ("end"). Per region: "issue" (the CTA's warps'
    turns, `share` cycles an instruction), "stall" (stall counts beyond that) and "wait" (for a scoreboard, a copy
    group or a barrier). `loops`: the tile loops (`structure`)."""
    names = ["pass 1", "pass 2"] if len(loops) == 2 else ["tiles"] * len(loops)

    def region(i: int) -> str:
        for (a, b), name in zip(loops, names, strict=True):
            if a <= i <= b:
                return name
        if i < loops[0][0]:
            return "setup"
        return "between" if i < loops[-1][0] else "end"

    cells: dict[int, dict[str, float]] = {}  # each instruction's region
    out: dict[str, dict[str, float]] = {}
    for i in seq[start:end]:
        if i not in cells:
            cells[i] = out.setdefault(region(i), {"issue": 0.0, "stall": 0.0, "wait": 0.0})
    step = {i: max(code[i].stall, share) for i in cells}
    ready = times[start]
    for pos in range(start, end):
        i = seq[pos]
        cell = cells[i]
        cell["wait"] += times[pos] - ready
        cell["issue"] += share
        cell["stall"] += step[i] - share
        ready = times[pos] + step[i]
    return out
