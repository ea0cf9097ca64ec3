"""The one error type for bad user input. The CLI turns it into exit code 2 with no traceback."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec, override or input file that cannot be run.

    `where` is the key path (`algorithm.lr`) or the file (and line) at fault; the message says what is
    wrong and how to fix it.
    """

    def __init__(self, where: str, problem: str, fix: str = "") -> None:
        self.where = where
        self.problem = problem
        self.fix = fix
        text = f"{where}: {problem}"
        if fix:
            text += f" — {fix}"
        super().__init__(text)


def require(ok: bool, where: str, problem: str, fix: str = "") -> None:
    """Raise `SpecError(where, problem, fix)` unless `ok`."""
    if not ok:
        raise SpecError(where, problem, fix)


def one_of(value: object, choices: tuple, where: str) -> None:
    """Refuse a value outside `choices`, listing them."""
    require(value in choices, where, f"{value!r} is not one of {', '.join(map(str, choices))}",
            f"set {where} to one of them")
