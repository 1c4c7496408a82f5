"""mbarrier lifetimes read from a kernel's PTX: while a barrier is live (from its ``mbarrier.init`` to its
``mbarrier.inval``), no other shared-memory access may touch its 8 bytes, and every barrier is invalidated.

PTX allows an mbarrier's memory to be used for anything else only after ``mbarrier.inval``. Triton's shared-memory
allocator does not know that: past a barrier's last use it may give the bytes to other values (in the Gluon
kernels, those passed into the warp-specialised partitions), so a barrier that is never invalidated can share its
bytes with plain loads and stores.

Addresses. Triton addresses shared memory from one symbol (``global_smem``): an operand is ``[global_smem+OFFSET]``
or ``[%reg+OFFSET]`` with ``%reg`` computed from the symbol (``mov.b32 %r1, global_smem; add.s32 %r2, %r1,
196880``) plus indices (a ring's stage, a thread's row, a warp's slot). Every register is read as an affine form,
``symbol + const + sum(k * atom)``, over atoms (registers that are not sums or constant multiples of others), so
that terms LLVM splits apart cancel again; each atom gets an interval from a small flow-insensitive analysis
(immediates, special registers with ``%tid.x`` bounded by ``.reqntid``, shifts, masks, selp, loop counters
widened). An address is then a range of offsets from the symbol. Two refinements keep the ranges tight:
- a remainder by a constant C, however the compiler spelt it (``rem``, ``x - ((x + bias) & -C)``, or ``x - C *
  (mul.hi(x, magic) >> s)``), lies in ``[-(C-1), C-1]``: a ring indexed by ``it % STAGES`` resolves to its slots;
- a counter modulo C (``r = selp(k, y + 1, y + 1 == C)`` where y is only ever r itself or a constant in
  ``[0, C-1]``, and k in ``[0, C-1]``) lies in ``[0, C-1]`` by induction: a ring whose stage is counted resolves
  to its slots too;
- a branch on ``setp`` of a register against a constant bounds that register in the blocks only that edge reaches:
  the worker partitions read their per-warp state at ``global_smem + warp + OFFSET`` only for worker warps.
A plain access whose range stays unbounded is reported as unresolved, never taken as safe.

"Between" is text order. Triton lays a kernel's warp-specialised partitions out between the code before
``gl.warp_specialize`` (where the barriers are initialised) and the code after it (where they are invalidated).
Every other barrier operation (wait, arrive, expect, a TMA copy's completion) is checked to lie within the
init..inval span of the barriers it may address, so a layout that broke that assumption shows as a problem. LLVM
may still place a loop of the default partition (which is not outlined) after the code that follows
``gl.warp_specialize``: an operation also lies within a span when the control-flow graph says so, that is, when the
init dominates it and it cannot be reached from the inval. LLVM may also place the worker partitions after the
return: the worker warps branch off before the inits and reach their code through a jump table (``brx.idx``) after
the rendezvous (``bar.sync 1``), so no init dominates it. An operation there lies within a span when the default
partition initialises before its first rendezvous and invalidates after a later one. A plain access is checked
against all of these: it is a problem if it touches a barrier's bytes where any order puts it inside the span.

Checked as plain shared accesses: ``ld``/``st``/``atom``/``red`` on ``.shared``, ``ldmatrix``/``stmatrix``,
``cp.async`` and the shared operand of ``cp.async.bulk`` copies (TMA: their first byte only, the box size is in
the descriptor). ``wgmma`` reads its operands through descriptors and is not checked.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

BARRIER_BYTES = 8
_MAX_ROUNDS = 16  # fixed-point rounds of the interval analysis
_WIDEN_AFTER = 3  # changes of a register's range before its moving bound is dropped
_MAX_DEPTH = 8  # definitions followed back when an address is re-evaluated under a block's branch conditions

# An abstract value: ("int", None, lo, hi) or ("addr", symbol, lo, hi); lo/hi None when unbounded. None: "any".
Value = tuple

_SPECIAL_MAX = {"%laneid": 31, "%tid.z": 63, "%ntid.x": 1024, "%ntid.y": 1024, "%ntid.z": 64}
_REG = re.compile(r"%[A-Za-z_$][\w$]*(?:\.[xyz])?")
_LABEL = re.compile(r"^\s*([$\w]+):\s*")
_FUNC = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)?\.(?:entry|func)\b")
_TERMINATORS = ("bra", "brx", "ret", "exit")
_RENDEZVOUS = re.compile(r"(?:bar|barrier)\.sync(?:\.aligned)? 1")  # warp specialisation's (id 1, all threads)
_CMP = {"lt": "lt", "lo": "lt", "le": "le", "ls": "le", "gt": "gt", "hi": "gt", "ge": "ge", "hs": "ge", "eq": "eq",
        "ne": "ne"}
_NEGATE = {"lt": "ge", "ge": "lt", "le": "gt", "gt": "le", "eq": "ne", "ne": "eq"}
_SWAP = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "eq": "eq", "ne": "ne"}


@dataclass
class Barrier:
    offset: int  # bytes from the shared symbol
    symbol: str
    init_line: int
    inval_line: int | None  # None: never invalidated

    def __str__(self) -> str:
        end = f"invalidated line {self.inval_line}" if self.inval_line else "never invalidated"
        return f"{self.symbol}+{self.offset} (initialised line {self.init_line}, {end})"


@dataclass
class BarrierReport:
    barriers: list[Barrier] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # broken lifetimes
    unresolved: list[str] = field(default_factory=list)  # plain shared accesses whose address has no bound
    checked: int = 0  # plain shared accesses with a bounded address

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unresolved

    def summary(self) -> str:
        lines = [f"{len(self.barriers)} barriers, {self.checked} shared accesses checked: "
                 + ", ".join(str(b) for b in self.barriers)]
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"unresolved: {u}" for u in self.unresolved]
        return "\n".join(lines)


@dataclass
class _Instr:
    line: int  # 1-based line in the PTX text
    text: str
    opcode: str  # ":" for a label
    operands: list[str]
    guard: tuple[str, bool] | None = None  # (predicate, taken when true)


@dataclass
class _Block:
    instrs: list[_Instr] = field(default_factory=list)
    succs: list[tuple[str, tuple[str, bool] | None]] = field(default_factory=list)  # (label, condition)
    label: str | None = None


@dataclass
class _Access:
    line: int
    text: str
    kind: str  # "init", "inval", "barrier" (any other mbarrier operation) or "plain"
    value: Value | None  # the start address
    width: int


# ---------------------------------------------------------------------------------------------------------------
# Parsing


def _split_operands(text: str) -> list[str]:
    """Operands separated by top-level commas (not inside [] or {})."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def _statement(line: int, stmt: str) -> _Instr | None:
    stmt = stmt.strip().lstrip("{").strip()
    guard = None
    m = re.match(r"@(!?)(%?[\w$]+)\s+", stmt)
    if m:
        guard, stmt = (m.group(2), not m.group(1)), stmt[m.end():]
    if not stmt or stmt.startswith((".", "}")):
        return None
    parts = stmt.split(None, 1)
    return _Instr(line, stmt, parts[0], _split_operands(parts[1]) if len(parts) > 1 else [], guard)


def _parse(lines: list[tuple[int, str]]) -> tuple[list[_Instr], dict[str, list[str]], int | None]:
    """A function's statements and labels in order, its jump tables, and its thread count (``.reqntid``). Labels
    inside a ``{ }`` scope (inline assembly: every wait loop has its own ``waitLoop``) get the scope's number."""
    instrs, tables, threads = [], {}, None
    buf, start, last_label = "", 0, None
    scopes, opened = [], 0

    def scoped(label: str) -> str:
        return f"{label}@{scopes[-1]}" if scopes else label

    for number, raw in lines:
        text = raw.split("//", 1)[0].strip()
        if not buf:
            if text.startswith("{"):
                opened += 1
                scopes.append(opened)
                text = text[1:].strip()
            if text.startswith("}"):
                scopes and scopes.pop()
                text = text[1:].strip()
            m = re.match(r"\.(?:reqntid|maxntid)\s+([\d\s,]+)", text)
            if m:
                dims = [int(d) for d in m.group(1).replace(",", " ").split()]
                threads = dims[0] * (dims[1] if len(dims) > 1 else 1) * (dims[2] if len(dims) > 2 else 1)
            while (m := _LABEL.match(text)) and not text.startswith("."):
                last_label = scoped(m.group(1))
                instrs.append(_Instr(number, text, ":", [last_label]))
                text = text[m.end():]
            if not text or text in ("{", "}", ")") or (text.startswith(".") and ";" not in text
                                                      and not text.startswith(".branchtargets")):
                continue
            start = number
        buf += " " + text
        while ";" in buf:
            stmt, buf = buf.split(";", 1)
            stmt = stmt.strip()
            if stmt.startswith(".branchtargets") and last_label:
                tables[last_label] = [scoped(t.strip()) for t in stmt[len(".branchtargets"):].split(",") if t.strip()]
            ins = _statement(start, stmt)
            if ins is not None:
                if ins.opcode.startswith("bra") and ins.operands:
                    ins.operands[0] = scoped(ins.operands[0])
                if ins.opcode.startswith("brx") and len(ins.operands) > 1:  # brx.idx index, table
                    ins.operands[1] = scoped(ins.operands[1])
                instrs.append(ins)
        buf = buf.strip()
    return instrs, tables, threads


def _functions(ptx: str) -> list[list[tuple[int, str]]]:
    """The lines of each ``.entry``/``.func``, numbered as in the whole text."""
    funcs: list[list[tuple[int, str]]] = []
    for number, line in enumerate(ptx.splitlines(), 1):
        if _FUNC.match(line):
            funcs.append([])
        if funcs:
            funcs[-1].append((number, line))
    return funcs


def _blocks(instrs: list[_Instr], tables: dict[str, list[str]]) -> list[_Block]:
    """Basic blocks: a label starts one, a branch or return ends one; successors with the branch's condition."""
    blocks = [_Block()]
    for ins in instrs:
        if ins.opcode == ":":
            if blocks[-1].instrs or blocks[-1].label:
                blocks.append(_Block())
            blocks[-1].label = ins.operands[0]
            continue
        blocks[-1].instrs.append(ins)
        if ins.opcode.split(".")[0] in _TERMINATORS:
            blocks.append(_Block())
    for i, block in enumerate(blocks):
        block.label = block.label or f"$block{i}"
    for i, block in enumerate(blocks):
        nxt = blocks[i + 1].label if i + 1 < len(blocks) else None
        last = block.instrs[-1] if block.instrs else None
        base = last.opcode.split(".")[0] if last else ""
        if base == "bra" and last.operands:
            block.succs.append((last.operands[0], last.guard))
        elif base == "brx" and len(last.operands) > 1:
            block.succs += [(target, None) for target in tables.get(last.operands[1], [])]
        if nxt and (base not in _TERMINATORS or last.guard is not None):  # falls through
            block.succs.append((nxt, None if base not in _TERMINATORS else (last.guard[0], not last.guard[1])))
    return blocks


# ---------------------------------------------------------------------------------------------------------------
# Values: affine forms over atoms, and the atoms' intervals


def _int(lo: int | None, hi: int | None) -> Value:
    return ("int", None, lo, hi)


def _nonneg(v: Value | None) -> bool:
    return v is not None and v[0] == "int" and v[2] is not None and v[2] >= 0


def _const(v: Value | None) -> int | None:
    return v[2] if v is not None and v[0] == "int" and v[2] is not None and v[2] == v[3] else None


def _join(a: Value | None, b: Value | None) -> Value | None:
    if a is None or b is None or a[:2] != b[:2]:
        return None
    lo = None if a[2] is None or b[2] is None else min(a[2], b[2])
    hi = None if a[3] is None or b[3] is None else max(a[3], b[3])
    return (a[0], a[1], lo, hi)


def _meet(a: Value | None, b: Value | None) -> Value | None:
    """Both hold: the tighter of each bound."""
    if a is None or b is None or a[:2] != b[:2]:
        return b if a is None else a
    lo = b[2] if a[2] is None else a[2] if b[2] is None else max(a[2], b[2])
    hi = b[3] if a[3] is None else a[3] if b[3] is None else min(a[3], b[3])
    return (a[0], a[1], lo, hi)


def _bits(opcode: str) -> int:
    m = re.search(r"\.[bsu](16|32|64)\b", opcode)
    return int(m.group(1)) if m else 32


def _fits(v: Value | None, bits: int) -> Value | None:
    """A range that may have wrapped around the register's width says nothing."""
    if v is None or (v[2] is not None and v[2] < -(1 << (bits - 1))) or (v[3] is not None and v[3] >= 1 << bits):
        return None
    return v


@dataclass(frozen=True)
class _Affine:
    """``symbol + const + sum(coeff * atom)``: registers computed by adds, subtracts and constant multiples of
    others are forms over the registers that are not (the atoms), so that correlated terms cancel (``x * 16376 -
    x * 16128`` is ``x * 248``, not the difference of two ranges)."""

    symbol: str | None
    const: int
    terms: tuple[tuple[str, int], ...]  # (atom, non-zero coefficient), sorted

    def plus(self, other: _Affine, sign: int = 1) -> _Affine | None:
        if other.symbol and (self.symbol or sign < 0):
            return None
        terms = dict(self.terms)
        for atom, k in other.terms:
            terms[atom] = terms.get(atom, 0) + sign * k
        return _Affine(self.symbol or other.symbol, self.const + sign * other.const,
                       tuple(sorted((a, k) for a, k in terms.items() if k)))

    def times(self, k: int) -> _Affine | None:
        if self.symbol:
            return None
        return _Affine(None, self.const * k, tuple((a, c * k) for a, c in self.terms if c * k))


class _Values:
    """What the registers of one function may hold. Every register is an affine form over atoms (registers that
    are not a sum or constant multiple of others); the atoms' intervals come from a flow-insensitive fixed point
    over their definitions, and can be narrowed by a block's branch conditions where an address is used."""

    def __init__(self, instrs: list[_Instr], symbols: set[str], threads: int | None):
        self.symbols = symbols
        tid = (threads or 1024) - 1
        self.special = {"%tid.x": tid, "%tid.y": tid, "%warpid": tid // 32, "%nwarpid": tid // 32 + 1,
                        **_SPECIAL_MAX}
        self.defs: dict[str, list[_Instr]] = {}
        self.opaque: set[str] = set()  # defined where this analysis gives no value: vector destinations, a|b pairs
        for ins in instrs:
            dest = ins.operands[0] if ins.opcode != ":" and ins.operands else ""
            if dest.startswith("{"):
                self.opaque.update(_REG.findall(dest))
            elif _REG.fullmatch(dest.split("|")[0]):
                self.defs.setdefault(dest.split("|")[0], []).append(ins)
                self.opaque.update(dest.split("|")[1:])
        self.forms: dict[str, _Affine] = {}
        self.env: dict[str, Value | None] = {r: None for r in self.opaque}  # atoms' intervals
        atoms = [r for r in self.defs if self.is_atom(r) and r not in self.opaque]
        changes: dict[str, int] = {}
        evaluated: set[int] = set()
        for _ in range(_MAX_ROUNDS):
            changed = False
            for atom in atoms:
                for ins in self.defs[atom]:
                    used = [r for r in _REG.findall(" ".join(ins.operands[1:])) if r not in self.special]
                    if any(a in self.defs and a not in self.env for r in used for a, _ in self.form(r).terms):
                        continue  # an operand without a value yet: waiting keeps "any" from sticking
                    evaluated.add(id(ins))
                    new = self._eval(ins, self.range_of)
                    if atom in self.env:
                        old = self.env[atom]
                        new = _join(old, new)
                        if new == old:
                            continue
                        changes[atom] = changes.get(atom, 0) + 1
                        if changes[atom] > _WIDEN_AFTER and new is not None and old is not None:
                            new = (new[0], new[1], new[2] if new[2] == old[2] else None,
                                   new[3] if new[3] == old[3] else None)
                    self.env[atom] = new
                    changed = True
            if not changed:
                break
        for atom in atoms:  # a definition never evaluated (its operands never got a value) leaves "any"
            if any(id(ins) not in evaluated for ins in self.defs[atom]):
                self.env[atom] = None

    def single_def(self, reg: str) -> _Instr | None:
        defs = self.defs.get(reg, [])
        return defs[0] if len(defs) == 1 and reg not in self.opaque else None

    def is_atom(self, reg: str) -> bool:
        return self.form(reg).terms == ((reg, 1),) and self.form(reg).const == 0 and not self.form(reg).symbol

    # -- forms

    def form(self, reg: str, depth: int = 0) -> _Affine:
        if reg not in self.forms:
            self.forms[reg] = _Affine(None, 0, ((reg, 1),))  # meanwhile (and if nothing better): an atom
            ins = self.single_def(reg)
            if ins is not None and depth < _MAX_DEPTH * 8 and self._remainder(ins) is None:
                form = self._affine(ins, depth)
                if form is not None:
                    self.forms[reg] = form
        return self.forms[reg]

    def operand_form(self, text: str, depth: int = 0) -> _Affine | None:
        text = text.strip()
        m = re.fullmatch(r"([%\w$.]+)\s*\+\s*(-?\w+)", text)
        if m:
            a, b = self.operand_form(m.group(1), depth), self.operand_form(m.group(2), depth)
            return None if a is None or b is None else a.plus(b)
        if text in self.symbols:
            return _Affine(text, 0, ())
        if text.startswith("%"):
            return self.form(text, depth + 1) if text not in self.special else _Affine(None, 0, ((text, 1),))
        c = _parse_int(text)
        return None if c is None else _Affine(None, c, ())

    def _affine(self, ins: _Instr, depth: int) -> _Affine | None:
        op = ins.opcode.split(".")[0]
        if op == "mul" and not ins.opcode.startswith(("mul.lo", "mul.wide")):
            return None
        if op == "mad" and not ins.opcode.startswith(("mad.lo", "mad.wide")):
            return None
        if op not in ("mov", "cvt", "add", "sub", "mul", "shl", "mad"):
            return None
        args = [self.operand_form(o, depth) for o in ins.operands[1:]]
        if any(a is None for a in args):
            return None
        if op in ("mov", "cvt") and len(args) == 1:
            return args[0]
        if op in ("add", "sub") and len(args) == 2:
            return args[0].plus(args[1], 1 if op == "add" else -1)
        if op == "shl" and len(args) == 2 and not args[1].terms:
            return args[0].times(1 << args[1].const)
        if op in ("mul", "mad") and len(args) >= 2:
            a, b = args[0], args[1]
            product = a.times(b.const) if not b.terms and not b.symbol else \
                b.times(a.const) if not a.terms and not a.symbol else None
            if product is None or op == "mul":
                return product
            return product.plus(args[2]) if len(args) == 3 else None
        return None

    # -- ranges

    def range_of(self, text: str, lookup=None) -> Value | None:
        """The range of an operand (a register, an immediate, a shared symbol, ``X+IMM``): its form over the atoms'
        intervals (``lookup(atom)``; by default the fixed point's)."""
        form = self.operand_form(text)
        if form is None:
            return None
        lo = hi = form.const
        for atom, k in form.terms:
            r = self.special_range(atom) or (lookup(atom) if lookup else self.env.get(atom))
            if r is None or r[0] != "int":
                return None
            ends = [None if e is None else e * k for e in (r[2], r[3])]
            if k < 0:
                ends.reverse()
            lo = None if lo is None or ends[0] is None else lo + ends[0]
            hi = None if hi is None or ends[1] is None else hi + ends[1]
        return _fits(("addr", form.symbol, lo, hi) if form.symbol else _int(lo, hi), 32 if form.symbol else 64)

    def special_range(self, reg: str) -> Value | None:
        return _int(0, self.special[reg]) if reg in self.special else None

    def resolve(self, text: str, facts: dict[str, Value]) -> Value | None:
        """An operand's range in a block whose entry satisfies ``facts`` (intervals of atoms): atoms defined from
        constrained ones are re-evaluated (a few definitions deep)."""
        memo: dict[str, Value | None] = {}

        def lookup(atom: str, depth: int = 0) -> Value | None:
            if atom not in memo:
                value = self.env.get(atom)
                ins = self.single_def(atom)
                if atom in facts:
                    value = _meet(value, facts[atom])
                elif ins is not None and depth < _MAX_DEPTH:
                    memo[atom] = value  # a cycle gets the unconstrained interval
                    value = _meet(value, self._eval(ins, lambda t: self.range_of(t, lambda a: lookup(a, depth + 1))))
                memo[atom] = value
            return memo[atom]

        return self.range_of(text, lookup)

    # -- atoms' intervals

    def _remainder(self, ins: _Instr) -> Value | None:
        """``a - b`` with b a multiple of C computed from a as a quotient: a remainder by C, however spelt."""
        if not ins.opcode.startswith("sub") or len(ins.operands) != 3:
            return None
        a, b = ins.operands[1], ins.operands[2]
        bdef = self.single_def(b)
        if bdef is None or len(bdef.operands) != 3:
            return None
        bop = bdef.opcode.split(".")[0]
        step = _parse_int(bdef.operands[2])
        if bop == "and" and step is not None and step < 0 and (-step) & (-step - 1) == 0:
            c = -step  # b = (a + bias) & -C with bias in [0, C-1]: the signed remainder's rounding
            if bdef.operands[1] == a:
                return _int(0, c - 1)
            tdef = self.single_def(bdef.operands[1])
            if tdef is None or not tdef.opcode.startswith("add") or len(tdef.operands) != 3:
                return None
            x, y = tdef.operands[1], tdef.operands[2]
            bias = self._eval_operand(y) if x == a else self._eval_operand(x) if y == a else None
            if _nonneg(bias) and bias[3] is not None and bias[3] < c:
                return _int(-bias[3], c - 1 - bias[2])
            return None
        if bop == "shl" and step is not None:
            c = 1 << step
        elif bop == "mul" and bdef.opcode.startswith("mul.lo") and step is not None and step > 0:
            c = step
        else:
            return None
        chain = self._chain(bdef.operands[1], a, 4)
        leaves = {r for d in chain for r in _REG.findall(" ".join(d.operands[1:]))} - {d.operands[0] for d in chain}
        ops = {d.opcode.split(".")[0] for d in chain}
        if not any(d.opcode.startswith("mul.hi") for d in chain) or not ops <= {"mul", "shr", "add", "sub"} \
                or leaves != {a}:
            return None  # not a quotient of a alone
        unsigned = all(".s" not in d.opcode for d in chain)
        return _int(0, c - 1) if unsigned else _int(-(c - 1), c - 1)

    def _modular_counter(self, ins: _Instr, evaluate) -> Value | None:
        """``r = selp(k, x, p)`` with ``p = (x == C)`` (or ``selp(x, k, x != C)``) and ``x = y + 1``, where every
        value y can hold (through movs) is r itself, a constant in [0, C-1] or a register whose interval
        (``evaluate``) lies there, and 0 <= k < C: r counts modulo C, so by induction r lies in [0, C-1]. The fixed
        point cannot see it: it widens r + 1 on every round."""
        if not ins.opcode.startswith("selp") or len(ins.operands) != 4:
            return None
        r, a, b, p = ins.operands
        pdef = self.single_def(p)
        if pdef is None or not pdef.opcode.startswith("setp.") or len(pdef.operands) != 3:
            return None
        cmp = pdef.opcode.split(".")[1]
        x, c = pdef.operands[1], _parse_int(pdef.operands[2])
        if c is None:
            x, c = pdef.operands[2], _parse_int(pdef.operands[1])
        k = _parse_int(a) if cmp == "eq" and b == x else _parse_int(b) if cmp == "ne" and a == x else None
        xdef = self.single_def(x)
        if c is None or c <= 0 or k is None or not 0 <= k < c or xdef is None or not xdef.opcode.startswith("add") \
                or ".f" in xdef.opcode or len(xdef.operands) != 3 or _parse_int(xdef.operands[2]) != 1:
            return None
        pending, seen = [xdef.operands[1]], set()
        while pending:  # every value y can hold: r, or constants in [0, C-1], through movs
            y = pending.pop()
            if y == r or y in seen:
                continue
            seen.add(y)
            if y in self.opaque or y not in self.defs:
                return None
            if not all(d.opcode.startswith("mov") and len(d.operands) == 2 for d in self.defs[y]):
                v = evaluate(y)  # e.g. a ring's phase bit, copied in as the stage's first 0
                if not _nonneg(v) or v[3] is None or v[3] >= c:
                    return None
                continue
            for d in self.defs[y]:
                v = _parse_int(d.operands[1])
                if v is None and d.operands[1].startswith("%") and d.operands[1] not in self.special:
                    pending.append(d.operands[1])
                elif v is None or not 0 <= v < c:
                    return None
        return _int(0, c - 1)

    def _eval_operand(self, text: str) -> Value | None:
        """An operand's interval from its own definition alone (no fixed point needed: shifts of constants)."""
        ins = self.single_def(text) if text.startswith("%") else None
        if ins is None:
            return self.range_of(text) if not text.startswith("%") else None
        return self._eval(ins, lambda t: self._eval_operand(t) if t.startswith("%") else self.range_of(t))

    def _chain(self, reg: str, stop: str, depth: int) -> list[_Instr]:
        """The definitions reg is computed by, back to ``stop``."""
        ins = self.single_def(reg)
        if ins is None or depth == 0 or reg == stop:
            return []
        out = [ins]
        for r in _REG.findall(" ".join(ins.operands[1:])):
            if r != stop:
                out += self._chain(r, stop, depth - 1)
        return out

    def _eval(self, ins: _Instr, evaluate) -> Value | None:
        """The interval of one definition, its operands' intervals from ``evaluate``."""
        rem = self._remainder(ins)
        if rem is not None:
            return rem
        counter = self._modular_counter(ins, evaluate)
        if counter is not None:
            return counter
        op = ins.opcode.split(".")[0]
        bits = _bits(ins.opcode)
        args = [evaluate(o) for o in ins.operands[1:]]
        if op in ("mov", "cvt", "shfl") and args:
            return args[0]  # shfl: some lane's value of the same register
        if op in ("add", "sub", "mul", "shl", "mad"):
            return self._affine_interval(op, ins, args, bits)
        if op == "shr" and len(args) == 2 and _const(args[1]) is not None:
            s = _const(args[1])
            x = args[0]
            exact = _int(x[2] >> s, None if x[3] is None else x[3] >> s) if _nonneg(x) else None
            if ".s" in ins.opcode:
                return exact
            return _meet(exact, _int(0, (1 << max(bits - s, 0)) - 1))  # a logical shift of any value of the width
        if op == "and" and len(args) == 2:
            masks = [_const(a) for a in args if _const(a) is not None and _const(a) >= 0]
            if masks:
                return _int(0, min(masks))
            if _nonneg(args[0]) and _nonneg(args[1]):
                his = [h for h in (args[0][3], args[1][3]) if h is not None]
                return _int(0, min(his) if his else None)
            return None
        if op in ("or", "xor") and len(args) == 2:
            if _nonneg(args[0]) and _nonneg(args[1]):
                his = (args[0][3], args[1][3])
                return _int(0, None if None in his else (1 << max(his).bit_length()) - 1)
            if op == "or" and args[0] is not None and args[0][0] == "addr" and _nonneg(args[1]) \
                    and args[0][2] is not None:  # x | y lies in [x, x + y] for y >= 0
                return ("addr", args[0][1], args[0][2], None if args[0][3] is None or args[1][3] is None
                        else args[0][3] + args[1][3])
            return None
        if op == "rem" and len(args) == 2 and (_const(args[1]) or 0) > 0:
            c = _const(args[1])
            return _int(0, c - 1) if _nonneg(args[0]) or ".u" in ins.opcode else _int(-(c - 1), c - 1)
        if op == "div" and len(args) == 2 and _nonneg(args[0]) and (_const(args[1]) or 0) > 0:
            c = _const(args[1])
            return _int(args[0][2] // c, None if args[0][3] is None else args[0][3] // c)
        if op == "bfe" and len(args) == 3 and _const(args[2]) is not None and ".u" in ins.opcode:
            return _int(0, (1 << _const(args[2])) - 1)
        if op in ("selp", "min", "max") and len(args) >= 2:
            return _join(args[0], args[1])
        return None

    @staticmethod
    def _affine_interval(op: str, ins: _Instr, args: list[Value | None], bits: int) -> Value | None:
        """add/sub/mul/shl/mad on intervals (for atoms: registers with several definitions)."""
        if any(a is None for a in args):
            return None

        def add(a: Value, b: Value, sign: int = 1) -> Value | None:
            if b[0] == "addr" and (sign < 0 or a[0] == "addr"):
                return None
            if b[0] == "addr":
                a, b = b, a
            ends = (b[2], b[3]) if sign > 0 else (None if b[3] is None else -b[3], None if b[2] is None else -b[2])
            return (a[0], a[1], None if a[2] is None or ends[0] is None else a[2] + ends[0],
                    None if a[3] is None or ends[1] is None else a[3] + ends[1])

        def mul(a: Value, b: Value) -> Value | None:
            if a[0] != "int" or b[0] != "int" or not (_nonneg(a) and _nonneg(b)):
                return None
            return _int(a[2] * b[2], None if a[3] is None or b[3] is None else a[3] * b[3])

        if op == "add" and len(args) == 2:
            out = add(args[0], args[1])
        elif op == "sub" and len(args) == 2:
            out = add(args[0], args[1], -1)
        elif op == "mul" and len(args) == 2 and ins.opcode.startswith(("mul.lo", "mul.wide")):
            out = mul(args[0], args[1])
        elif op == "shl" and len(args) == 2 and _const(args[1]) is not None:
            out = mul(args[0], _int(1 << _const(args[1]), 1 << _const(args[1])))
        elif op == "mad" and len(args) == 3 and ins.opcode.startswith(("mad.lo", "mad.wide")):
            product = mul(args[0], args[1])
            out = None if product is None else add(product, args[2])
        else:
            return None
        return _fits(out, bits)


def _parse_int(text: str) -> int | None:
    if re.fullmatch(r"0[fFdD][0-9A-Fa-f]+", text.strip()):
        return None  # a float's bits
    try:
        return int(text.strip(), 0)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# Branch conditions


def _condition(values: _Values, cond: tuple[str, bool] | None) -> dict[str, Value]:
    """What an edge taken when predicate ``cond[0]`` is ``cond[1]`` says of a single-definition register."""
    if cond is None:
        return {}
    ins = values.single_def(cond[0])
    if ins is None or not ins.opcode.startswith("setp.") or len(ins.operands) != 3:
        return {}
    parts = ins.opcode.split(".")
    if len(parts) < 3 or parts[1] not in _CMP or parts[2].startswith("f"):
        return {}
    cmp = _CMP[parts[1]]
    x, y = ins.operands[1], ins.operands[2]
    c = _parse_int(y)
    if c is None:
        x, y, cmp, c = y, x, _SWAP[cmp], _parse_int(x)
    if c is None or not x.startswith("%") or values.single_def(x) is None or not values.is_atom(x):
        return {}
    if not cond[1]:
        cmp = _NEGATE[cmp]
    bound = {"lt": _int(None, c - 1), "le": _int(None, c), "gt": _int(c + 1, None), "ge": _int(c, None),
             "eq": _int(c, c)}.get(cmp)
    if bound is None:
        return {}
    if parts[2].startswith("u") or parts[2].startswith("b"):
        bound = _meet(bound, _int(0, None))  # an unsigned compare: a non-negative value
    return {x: bound}


def _entry_facts(blocks: list[_Block], values: _Values) -> list[dict[str, Value]]:
    """For each block, the register ranges that hold on every path into it."""
    index = {b.label: i for i, b in enumerate(blocks) if b.label}
    facts: list[dict[str, Value] | None] = [None] * len(blocks)
    facts[0] = {}
    work = [0]
    while work:
        i = work.pop()
        for label, cond in blocks[i].succs:
            j = index.get(label)
            if j is None:
                continue
            out = dict(facts[i])
            for reg, bound in _condition(values, cond).items():
                out[reg] = _meet(out.get(reg), bound)
            if facts[j] is None:
                new = out
            else:
                new = {r: _join(facts[j][r], out[r]) for r in facts[j].keys() & out.keys()}
                new = {r: v for r, v in new.items() if v is not None}
            if new != facts[j]:
                facts[j] = new
                work.append(j)
    return [f or {} for f in facts]


# ---------------------------------------------------------------------------------------------------------------
# Accesses


def _width(opcode: str) -> int:
    if opcode.startswith(("ldmatrix", "stmatrix")):
        return 16  # one 8 x 16-byte row per address
    size = 1
    for part in opcode.split("."):
        if re.fullmatch(r"[bsuf](8|16|32|64|128)", part):
            size = int(part[1:]) // 8
    vec = re.search(r"\.v(\d)\b", opcode)
    return size * (int(vec.group(1)) if vec else 1)


def _accesses(ins: _Instr, resolve) -> list[_Access]:
    op = ins.opcode
    brackets = [o[1:-1] for o in ins.operands if o.startswith("[") and o.endswith("]")]
    if not brackets:
        return []

    def access(kind: str, operand: str, width: int) -> _Access:
        return _Access(ins.line, ins.text, kind, resolve(operand), width)

    if op.startswith("mbarrier."):
        kind = {"init": "init", "inval": "inval"}.get(op.split(".")[1], "barrier")
        return [access(kind, brackets[0], BARRIER_BYTES)]
    if op.startswith("cp.async.mbarrier"):
        return [access("barrier", brackets[0], BARRIER_BYTES)]
    if op.startswith(("cp.async.bulk", "cp.reduce.async.bulk")):
        out = [access("barrier", brackets[-1], BARRIER_BYTES)] if "mbarrier::" in op else []
        if re.search(r"\.shared(::\w+)?\.global", op):  # global -> shared: the destination
            out.append(access("plain", brackets[0], 1))
        elif re.search(r"\.global\.shared", op) and len(brackets) > 1:  # shared -> global: the source
            out.append(access("plain", brackets[1], 1))
        return out
    if op.startswith("cp.async.") and ".shared" in op:
        size = _const(resolve(ins.operands[2])) if len(ins.operands) > 2 else None
        return [access("plain", brackets[0], size or 16)]
    if ".shared" in op and op.split(".")[0] in ("ld", "st", "atom", "red", "ldmatrix", "stmatrix", "ldu"):
        return [access("plain", brackets[0], _width(op))]
    return []


# ---------------------------------------------------------------------------------------------------------------
# The check


def check_barrier_lifetimes(ptx: str) -> BarrierReport:
    """Check every function of ``ptx``: each ``mbarrier.init`` has a matching ``mbarrier.inval`` of the same
    bytes, no plain shared access touches a barrier's bytes between the two, every other barrier operation lies
    between them, and every plain shared access has a bounded address."""
    report = BarrierReport()
    symbols = set(re.findall(r"\.shared\b[^;]*?\s([A-Za-z_$][\w$]*)\s*\[", ptx))
    for lines in _functions(ptx):
        instrs, tables, threads = _parse(lines)
        values = _Values(instrs, symbols, threads)
        blocks = _blocks(instrs, tables)
        accesses = []
        for block, facts in zip(blocks, _entry_facts(blocks, values)):
            for ins in block.instrs:
                accesses += _accesses(ins, functools.partial(values.resolve, facts=facts))
        spans = _barrier_spans(accesses, lines[-1][0], report)
        flow = _Flow(blocks)
        for acc in accesses:
            if acc.kind not in ("init", "inval"):
                _check_access(acc, spans, report, flow)
    return report


class _Flow:
    """Dominators and reachability of a function's blocks, by the lines of their statements: whether a statement
    lies within an init..inval span by the control-flow graph."""

    def __init__(self, blocks: list[_Block]):
        index = {b.label: i for i, b in enumerate(blocks)}
        self.succs = [[index[label] for label, _ in b.succs if label in index] for b in blocks]
        self.block_of = {ins.line: i for i, b in enumerate(blocks) for ins in b.instrs}
        preds: list[list[int]] = [[] for _ in blocks]
        for i, out in enumerate(self.succs):
            for j in out:
                preds[j].append(i)
        order, seen, stack = [], {0}, [(0, iter(self.succs[0]))] if blocks else []
        while stack:  # postorder from the entry
            node, it = stack[-1]
            nxt = next((j for j in it if j not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(self.succs[nxt])))
        rpo = order[::-1]
        rank = {b: k for k, b in enumerate(rpo)}
        self.idom = {0: 0} if blocks else {}

        def common(a: int, b: int) -> int:
            while a != b:
                while rank[a] > rank[b]:
                    a = self.idom[a]
                while rank[b] > rank[a]:
                    b = self.idom[b]
            return a

        changed = True
        while changed:  # Cooper, Harvey and Kennedy's iterative dominators
            changed = False
            for b in rpo[1:]:
                done = [p for p in preds[b] if p in self.idom]
                new = done[0]
                for p in done[1:]:
                    new = common(p, new)
                if self.idom.get(b) != new:
                    self.idom[b], changed = new, True
        self._reach: dict[int, set[int]] = {}
        # Warp specialisation's rendezvous: the worker warps wait at bar.sync 1, then branch through a jump table
        # (brx.idx) to their partition's code; the default partition's own bar.sync 1 start and end them.
        tables = [j for i, b in enumerate(blocks) if b.instrs and b.instrs[-1].opcode.startswith("brx")
                  for j in self.succs[i]]
        self.worker_blocks = set(tables).union(*(self._reachable(j) for j in tables))
        self.rendezvous = sorted(ins.line for i, b in enumerate(blocks) if i not in self.worker_blocks
                                 for ins in b.instrs if _RENDEZVOUS.fullmatch(f"{ins.opcode} {' '.join(ins.operands)}"))

    def _dominates(self, a: int, b: int) -> bool:
        if b not in self.idom:
            return False
        while b != a and self.idom[b] != b:
            b = self.idom[b]
        return b == a

    def _reachable(self, a: int) -> set[int]:
        """The blocks reached from block a by one edge or more."""
        if a not in self._reach:
            seen, work = set(), list(self.succs[a])
            while work:
                b = work.pop()
                if b not in seen:
                    seen.add(b)
                    work += self.succs[b]
            self._reach[a] = seen
        return self._reach[a]

    def within(self, line: int, start: int, stop: int | None) -> bool:
        """The statement at ``line`` runs after the init at ``start`` (which dominates it) and cannot run after the
        inval at ``stop`` (None: none); or it is a worker partition's, and the default partition initialises
        before its first rendezvous and invalidates after the last rendezvous that precedes the inval (the end of
        the partitions)."""
        b, bs = self.block_of.get(line), self.block_of.get(start)
        if b in self.worker_blocks and self.rendezvous:
            ends = [r for r in self.rendezvous if stop is None or r < stop]
            return start < self.rendezvous[0] and len(ends) > 1
        if b is None or bs is None or not (line > start if b == bs else self._dominates(bs, b)):
            return False
        if stop is None:
            return True
        be = self.block_of.get(stop)
        return be is not None and b not in self._reachable(be) and not (b == be and line > stop)


def _inside(line: int, start: int, stop: int, flow: _Flow, barrier: Barrier) -> bool:
    """Within the barrier's init..inval span (``stop``: the function's end if it has no inval) by text order or by
    the control-flow graph."""
    return start <= line <= stop or flow.within(line, start, stop if barrier.inval_line is not None else None)


def _check_access(acc: _Access, spans: list[tuple[Barrier, int, int]], report: BarrierReport, flow: _Flow) -> None:
    v = acc.value
    if v is None or v[0] != "addr" or v[2] is None or v[3] is None:
        if acc.kind == "plain":
            report.unresolved.append(f"line {acc.line}: {acc.text}")
        elif not any(_inside(acc.line, start, stop, flow, b) for b, start, stop in spans):
            # Unbounded, it is still some barrier (every init is a constant): it must lie where one is live.
            report.problems.append(f"line {acc.line}: `{acc.text}` lies where no barrier is live")
        return
    lo, hi = v[2], v[3] + acc.width  # the bytes it may touch: [lo, hi)
    touched = [(b, s, e) for b, s, e in spans if b.symbol == v[1] and lo < b.offset + BARRIER_BYTES and b.offset < hi]
    if acc.kind == "plain":
        report.checked += 1
        for b, start, stop in touched:
            if _inside(acc.line, start, stop, flow, b):
                report.problems.append(f"line {acc.line}: `{acc.text}` touches the live barrier {b}")
    elif not touched:
        report.problems.append(f"line {acc.line}: `{acc.text}` addresses no initialised barrier")
    elif not any(_inside(acc.line, start, stop, flow, b) for b, start, stop in touched):
        report.problems.append(f"line {acc.line}: `{acc.text}` lies outside the init..inval span of "
                               + ", ".join(str(b) for b, _, _ in touched))


def _barrier_spans(accesses: list[_Access], end: int, report: BarrierReport) -> list[tuple[Barrier, int, int]]:
    """(barrier, first line, last line) of every init..inval span, in text order; an init without an inval lives
    to the function's end."""
    spans: list[tuple[Barrier, int, int]] = []
    live: dict[tuple[str, int], Barrier] = {}
    for acc in sorted((a for a in accesses if a.kind in ("init", "inval")), key=lambda a: a.line):
        v = acc.value
        if v is None or v[0] != "addr" or v[2] is None or v[2] != v[3]:
            report.problems.append(f"line {acc.line}: `{acc.text}`: the barrier's address is not one constant")
            continue
        key = (v[1], v[2])
        if acc.kind == "init":
            clash = [b for (s, o), b in live.items() if s == v[1] and abs(o - v[2]) < BARRIER_BYTES]
            if clash:
                report.problems.append(f"line {acc.line}: `{acc.text}` initialises over the live barrier {clash[0]}")
                continue
            live[key] = Barrier(v[2], v[1], acc.line, None)
        else:
            barrier = live.pop(key, None)
            if barrier is None:
                report.problems.append(f"line {acc.line}: `{acc.text}` invalidates no live barrier")
                continue
            barrier.inval_line = acc.line
            report.barriers.append(barrier)
            spans.append((barrier, barrier.init_line, acc.line))
    for barrier in live.values():
        report.problems.append(f"barrier {barrier}: no mbarrier.inval")
        report.barriers.append(barrier)
        spans.append((barrier, barrier.init_line, end))
    report.barriers.sort(key=lambda b: (b.symbol, b.offset, b.init_line))
    return spans
