"""A calculator tool that evaluates arithmetic only: numbers, + - * / // % ** and parentheses.

The expression is parsed with `ast` and walked node by node; anything else (names, calls, attributes,
subscripts) is refused, so model-written text is never executed. Sizes are bounded so a model cannot ask
for ``9**9**9``.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is shown to the model)."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic `expression` (``1,000`` is read as one thousand)."""
    text = _THOUSANDS.sub("", expression.strip())
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"give an expression of 1 to {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {text!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, TypeError) as err:  # e.g. a complex power
            raise CalculatorError(str(err)) from None
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"result out of range (|x| <= {MAX_MAGNITUDE:g})")
    return value


def format_number(value: int | float) -> str:
    """Integers without a decimal point; other values rounded to 6 significant decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"
