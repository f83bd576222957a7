"""Exercises: the learner answers in a cell of their own, a check cell says whether the answer holds.

    answer = None                      # the learner replaces None, then runs the check below
    print(check(answer, measured, solution="4 tensors × ... = 1,310,720"))

The check cell's output starts collapsed in JupyterLab (the cell's `outputs_hidden` metadata), so
the worked solution it prints stays out of sight until the learner opens it. Where the exercise asks
for the working itself, pass a `hint` as well: the solution is then withheld until the answer is
right, and a wrong answer (or none yet) gets the hint instead. The expected value
comes from what the ranks measured, never from the solution's own formula: the notebook asserts
that the two agree, so an exercise whose solution went stale fails under nbval.
"""

from __future__ import annotations

import math


def check(answer, expected, *, solution: str, hint: str | None = None, rel_tol: float = 1e-6) -> str:
    """Whether `answer` equals `expected` (numbers within `rel_tol`; sequences item by item), as a
    sentence; before an answer (None) it says so and gives the worked solution. With a `hint`, the
    solution (and `expected`) is said only to a right answer: none yet, or a wrong one, gets the hint."""
    if answer is None:
        if hint is not None:
            return f"no answer yet: replace None in the cell above, then run this cell again.\nHint: {hint}"
        return f"no answer yet: replace None in the cell above, then run this cell again.\nSolution: {solution}"
    if _same(answer, expected, rel_tol):
        return f"right: {answer!r}.\nSolution: {solution}"
    if hint is not None:
        return f"not yet: {answer!r} is not what the ranks measured.\nHint: {hint}"
    return f"not yet: {answer!r} is not what the ranks measured. Think again, or open the solution:\n{solution}"


def _same(answer, expected, rel_tol: float) -> bool:
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(answer, (list, tuple))
            and len(answer) == len(expected)
            and all(_same(a, e, rel_tol) for a, e in zip(answer, expected))
        )
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        return (
            isinstance(answer, (int, float))
            and not isinstance(answer, bool)
            and math.isclose(answer, expected, rel_tol=rel_tol)
        )
    return answer == expected
