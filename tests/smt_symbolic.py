"""Run the project's own integer functions on symbolic integers, for the SMT tests (test_smt_lemmas.py).

A function such as `tiling.causal_kind(r0, r1, c0, c1, delta)` is plain Python over ints: arithmetic,
comparisons, `if`, `min` and `max`. Called with `Sym` values it builds z3 terms instead of numbers, and
every `if` on a symbolic comparison becomes a branch: `explore` runs the function once per feasible path
(depth first, asking z3 which sides of each branch the assumptions allow) and returns, per path, the
conjunction of the branch conditions taken and the value returned. Each returned path is a case of the
function, exactly as the code wrote it, so a property proved for every path is proved of the code, for
all integers the assumptions allow (unbounded, as Python's ints are).

Floor division `a // b` becomes z3's integer division, which equals Python's floor division when b > 0;
each such division records the obligation b > 0 under its path, and `explore` proves it.
"""

from __future__ import annotations

from dataclasses import dataclass

import z3


class Infeasible(Exception):
    """The forced decisions of a path contradict the assumptions (never raised for a path explore picks)."""


class _Path:
    """The decisions of one run: forced ones (a prefix from an earlier run), then free ones."""

    def __init__(self, solver: z3.Solver, forced: list[bool]):
        self.solver = solver
        self.forced = forced
        self.decisions: list[bool] = []
        self.conditions: list[z3.BoolRef] = []
        self.alternatives: list[list[bool]] = []  # decision prefixes still to run
        self.obligations: list[tuple[list[z3.BoolRef], z3.BoolRef, str]] = []

    def _feasible(self, condition) -> bool:
        return self.solver.check(*self.conditions, condition) != z3.unsat

    def decide(self, condition: z3.BoolRef) -> bool:
        index = len(self.decisions)
        if index < len(self.forced):
            taken = self.forced[index]
        else:
            can_true, can_false = self._feasible(condition), self._feasible(z3.Not(condition))
            if not (can_true or can_false):
                raise Infeasible("no side of a branch is feasible")
            taken = can_true
            if can_true and can_false:
                self.alternatives.append(self.decisions + [False])
        self.decisions.append(taken)
        self.conditions.append(condition if taken else z3.Not(condition))
        return taken


def _term(x):
    if isinstance(x, tuple):
        return tuple(_term(e) for e in x)
    return x.term if isinstance(x, Sym) else x


class SymBool:
    """A symbolic comparison; `bool()` of it branches (the path decides which side it is on)."""

    def __init__(self, term: z3.BoolRef, path: _Path):
        self.term, self.path = term, path

    def __bool__(self):
        return self.path.decide(self.term)


class Sym:
    """A symbolic integer: the operators the project's tile arithmetic uses."""

    def __init__(self, term: z3.ArithRef, path: _Path):
        self.term, self.path = term, path

    def _new(self, term):
        return Sym(term, self.path)

    def __add__(self, other):
        return self._new(self.term + _term(other))

    __radd__ = __add__

    def __sub__(self, other):
        return self._new(self.term - _term(other))

    def __rsub__(self, other):
        return self._new(_term(other) - self.term)

    def __mul__(self, other):
        return self._new(self.term * _term(other))

    __rmul__ = __mul__

    def __neg__(self):
        return self._new(-self.term)

    def _floordiv(self, a, b):
        self.path.obligations.append((list(self.path.conditions), b > 0, f"divisor {b} > 0"))
        return self._new(a / b)  # SMT-LIB div: floor division for a positive divisor

    def __floordiv__(self, other):
        return self._floordiv(self.term, _term(other))

    def __rfloordiv__(self, other):
        return self._floordiv(_term(other), self.term)

    def __lt__(self, other):
        return SymBool(self.term < _term(other), self.path)

    def __le__(self, other):
        return SymBool(self.term <= _term(other), self.path)

    def __gt__(self, other):
        return SymBool(self.term > _term(other), self.path)

    def __ge__(self, other):
        return SymBool(self.term >= _term(other), self.path)

    def __eq__(self, other):
        return SymBool(self.term == _term(other), self.path)

    def __ne__(self, other):
        return SymBool(self.term != _term(other), self.path)

    __hash__ = None


@dataclass(frozen=True)
class Case:
    """One path of a function: the branch conditions it took and what it returned (a z3 term for Sym)."""

    condition: z3.BoolRef
    value: object


def explore(fn, variables: dict[str, z3.ArithRef], assumptions: list[z3.BoolRef]) -> list[Case]:
    """Every feasible path of fn(**{name: Sym}) under the assumptions. fn receives the symbolic arguments
    as keywords and may also read `path` (to make further Sym values: `Sym(term, path)`)."""
    solver = z3.Solver()
    solver.add(*assumptions)
    pending: list[list[bool]] = [[]]
    cases = []
    while pending:
        path = _Path(solver, pending.pop())
        args = {name: Sym(term, path) for name, term in variables.items()}
        value = fn(path=path, **args)
        for conditions, obligation, what in path.obligations:
            if solver.check(*conditions, z3.Not(obligation)) != z3.unsat:
                raise AssertionError(f"not proved under the assumptions: {what} (model {solver.model()})")
        pending.extend(path.alternatives)
        cases.append(Case(z3.And(*path.conditions) if path.conditions else z3.BoolVal(True), _term(value)))
    return cases


def counterexample(assumptions: list[z3.BoolRef], claim: z3.BoolRef):
    """None if the assumptions imply the claim (z3 proves it: the negation is unsat), else a model."""
    solver = z3.Solver()
    solver.add(*assumptions, z3.Not(claim))
    result = solver.check()
    if result == z3.unsat:
        return None
    if result == z3.unknown:
        raise AssertionError(f"z3 could not decide the claim: {solver.reason_unknown()}")
    return solver.model()
