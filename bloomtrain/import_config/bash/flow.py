"""Which commands of a launch script run: `if`/`elif`/`else`, `case`, loops and `&&`/`||`.

Megatron-DeepSpeed's example scripts set options under conditions (`if [ "$ZERO" = "0" ]; then
...; fi`, `[ -n "$BIG" ] && TP=8`). Running every assignment regardless, as a reader without
control flow does, converts the branch bash would not take. Here a condition import-config can
decide (a `[`/`[[`/`test` over known strings and integers, `true`, `false`) picks its branch as
bash would; one it cannot decide (a file test, a command's status, a loop, a `case`) makes the
commands under it *maybe*: a variable they set to a new value is unknown afterwards, and a
mapped argument that uses it is an error naming it (pass --var), never a silent guess.

A command runs in one of three modes: RUN, MAYBE or SKIP, the least of its enclosing blocks' and
of its `&&`/`||` chain's."""
from __future__ import annotations

from dataclasses import dataclass

from bloomtrain.import_config.bash.lexer import unresolved_in

SKIP, MAYBE, RUN = 0, 1, 2
_BRANCH = {True: RUN, False: SKIP, None: MAYBE}
_INT_TESTS = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__,
              "-gt": int.__gt__, "-ge": int.__ge__}


@dataclass
class _Block:
    kind: str            # if, loop, case
    mode: int            # the mode of the commands in its current part
    taken: bool | None   # (if) some earlier branch ran: yes, no, or not known


class Flow:
    """The blocks open at the current command and the last command's exit status (True for
    success, None where it cannot be known without running it)."""

    def __init__(self):
        self.blocks: list[_Block] = []
        self.status: bool | None = True

    def mode(self) -> int:
        return min((b.mode for b in self.blocks), default=RUN)

    def chained(self, sep: str) -> int:
        """The mode `&&`/`||` before a command gives it (a skipped command keeps the status)."""
        if sep not in ("&&", "||"):
            return RUN
        if self.status is None:
            return MAYBE
        return RUN if self.status == (sep == "&&") else SKIP

    def keyword(self, word: str) -> bool:
        """Open, switch or close a block on a leading keyword; False if `word` is none."""
        if word in ("if", "while", "until", "for", "case"):
            kind = "if" if word == "if" else "case" if word == "case" else "loop"
            # A loop may run its body any number of times, a case any of its branches: both
            # only MAYBE. An if's condition runs; its branches are decided at `then`.
            self.blocks.append(_Block(kind, RUN if kind == "if" else MAYBE, False))
        elif word == "elif" and self._top("if"):
            top = self.blocks[-1]
            top.mode = {True: SKIP, False: RUN, None: MAYBE}[top.taken]
        elif word in ("then", "else") and self._top("if"):
            self._branch(self.blocks[-1], True if word == "else" else self.status)
        elif word in ("fi", "done", "esac"):
            if self.blocks:
                self.blocks.pop()
            self.status = None if word != "fi" else self.status
        elif word not in ("do", "{", "}"):
            return False
        return True

    def _top(self, kind: str) -> bool:
        return bool(self.blocks) and self.blocks[-1].kind == kind

    @staticmethod
    def _branch(block: _Block, cond: bool | None) -> None:
        if block.taken is True:
            block.mode = SKIP
        elif block.taken is False:
            block.mode, block.taken = _BRANCH[cond], cond
        else:  # an earlier branch may have run
            block.mode = SKIP if cond is False else MAYBE
            block.taken = True if cond is True else None


def test_status(name: str, args: list[str]) -> bool | None:
    """The exit status of `true`, `false`, `:` or a `[`/`[[`/`test` over `args` (expanded), or
    None where it depends on what is not known here (files, unresolved values, other
    commands)."""
    if name in ("true", ":"):
        return True
    if name == "false":
        return False
    if name not in ("[", "[[", "test"):
        return None
    if name != "test":
        if not args or args[-1] != ("]" if name == "[" else "]]"):
            return None
        args = args[:-1]
    if unresolved_in(args) is not None:
        return None
    if name == "[[" and len(args) == 3 and args[1] in ("=", "==", "!=") and \
            any(c in args[2] for c in "*?["):
        return None  # [[ ]] matches the right side as a glob pattern
    return _expression(args)


def _expression(args: list[str]) -> bool | None:
    if args[:1] == ["!"]:
        inner = _expression(args[1:])
        return None if inner is None else not inner
    if len(args) == 0:
        return False
    if len(args) == 1:
        return args[0] != ""
    if len(args) == 2:
        op, value = args
        return {"-n": value != "", "-z": value == ""}.get(op)
    if len(args) == 3:
        left, op, right = args
        if op in ("=", "=="):
            return left == right
        if op == "!=":
            return left != right
        if op in _INT_TESTS:
            try:
                return _INT_TESTS[op](int(left), int(right))
            except ValueError:
                return None
    return None
