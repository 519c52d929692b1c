"""The errors every module may raise. A leaf: it imports nothing, so that raising an error never
ties a module to the config, the model or torch."""


class UserError(Exception):
    """An error caused by the user's input or environment. The CLI prints it without a
    traceback, so the message must say what to change."""


class UserValueError(UserError, ValueError):
    """A bad value handed to a function that callers of the Python API catch as ValueError
    (an lm-eval task's settings handed to the eval model), and the CLI prints as a UserError."""


def raise_all(problems: list[str]) -> None:
    """One UserError for every problem found, nothing when there is none: a single problem as
    it is, several each on its own line under their count, so that one run of a command shows
    all there is to change, not one rule per attempt."""
    if len(problems) == 1:
        raise UserError(problems[0])
    if problems:
        error = UserError(f"{len(problems)} problems; change each of these:\n"
                          + "\n".join(f"  - {p}" for p in problems))
        error.problems = list(problems)
        raise error


def each_problem(error: UserError) -> list[str]:
    """The problems `error` names: those raise_all gathered into it, else its one message."""
    return list(getattr(error, "problems", [str(error)]))
