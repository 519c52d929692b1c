"""Reading a Megatron launch without running it: a bash/SLURM launch script, or an args file.

What a launch script holds is found the way bash would find it, for the part of bash such
scripts use: comments, line continuations, single and double quotes, variables (`$X`, `${X}`,
`${X:-default}`) assigned earlier in the script or given with --var, `$(( ))` arithmetic,
`export`, arrays (`A=( ... )`, `${A[@]}`), heredocs (`cat <<EOT > ds_config.json` writes the ds_config), and `bash -c "..."`
(SLURM scripts hand the launch to `srun ... bash -c`). Nothing is executed: a command
substitution (`$(hostname)`, `` `pwd` ``) or a variable nobody defines stays an *unresolved*
marker in the text, and only a value that is actually used (a mapped argument, a launcher size)
is an error, naming it. Quotes inside a variable's value are honoured when it is expanded, as the
script's author meant them (bash would keep them literally, unless `bash -c` re-reads them).

The launch is the command that runs the program under a distributed launcher (torchrun,
`python -m torch.distributed.run|launch`, `deepspeed`) or a `pretrain_*.py`/`finetune*.py` run by
python; its launcher options and `#SBATCH` lines give the world size.
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass

from bloomtrain.errors import UserError

_OPEN, _CLOSE = "\ue000", "\ue001"
# A marker's text is shifted into a private-use plane so that no character of it means anything
# to the lexer when a string holding it is read again (`bash -c`).
_SHIFT = 0xF0000
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
_MARKER = re.compile(f"{_OPEN}([^{_CLOSE}]*){_CLOSE}")


def mark(text: str) -> str:
    """A stand-in for `text` (`$X`, `$(cmd)`) that could not be resolved."""
    return _OPEN + "".join(chr(_SHIFT + min(ord(c), 0xFFFD)) for c in text) + _CLOSE


def _unshift(body: str) -> str:
    return "".join(chr(ord(c) - _SHIFT) for c in body)


def unresolved_in(value) -> str | None:
    """The first unresolved reference in `value` (a str or a list of str), as the script spelled
    it, or None."""
    for text in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(text, str) and (m := _MARKER.search(text)):
            return _unshift(m.group(1))
    return None


def show(value) -> str:
    """`value` for printing, unresolved references written as the script spelled them."""
    if isinstance(value, (list, tuple)):
        return " ".join(show(v) for v in value)
    return _MARKER.sub(lambda m: _unshift(m.group(1)), str(value))


@dataclass
class Part:
    kind: str           # lit, var, cmd (command substitution), arith
    text: str
    quoted: bool
    default: list["Part"] | None = None   # ${NAME:-default}
    op: str = ""                           # its operator: -, :-, = or :=; [@] or [*] (arrays)
    items: list[list["Part"]] | None = None   # kind "array": the words of NAME=( ... )


@dataclass
class Command:
    words: list[list[Part]]
    line: int
    heredoc: list[Part] | None = None
    output: list[Part] | None = None      # the file `> FILE` writes
    sep: str = "\n"                        # the operator before it: ; && || | & ( ) or newline


class Lexer:
    """Bash's words and commands. In `words_only` mode (the value of an unquoted variable) only
    blanks separate words and nothing else is an operator."""

    def __init__(self, text: str, words_only: bool = False, first_line: int = 1):
        self.s, self.i, self.line, self.words_only = text, 0, first_line, words_only
        self.pending: list[tuple[str, bool, bool, Command]] = []

    def _peek(self, k: int = 0) -> str:
        return self.s[self.i + k] if self.i + k < len(self.s) else ""

    def _fail(self, what: str):
        raise UserError(f"line {self.line}: {what}")

    def commands(self) -> list[Command]:
        done: list[Command] = []
        cur = Command([], self.line)
        last_end = -1
        while self.i < len(self.s):
            c = self._peek()
            if c in " \t\r" or c == "\n" and self.words_only:
                self.line += c == "\n"
                self.i += 1
            elif c == "\\" and self._peek(1) == "\n":
                self.i += 2
                self.line += 1
            elif c == "\n" and not self.words_only:
                self.i += 1
                self.line += 1
                self._read_heredocs()
                cur = self._end(done, cur, "\n")
            elif c == "#" and not self.words_only:
                while self.i < len(self.s) and self._peek() != "\n":
                    self.i += 1
            elif (c in "<>" or c == "&" and self._peek(1) == ">") and not self.words_only:
                if cur.words and last_end == self.i and all(
                        p.kind == "lit" and p.text.isdigit() for p in cur.words[-1]):
                    cur.words.pop()  # the fd of `2>&1`
                self._redirect(cur)
            elif c == "(" and self._peek(1) == "(" and not cur.words and not self.words_only:
                # `(( X += 2 ))`, an arithmetic command: one quoted word after "((", for the
                # evaluator to find what it assigns (bash.launch._changed).
                body = self._balanced("(", ")")
                cur.words += [[Part("lit", "((", False)], [Part("lit", body[2:-2], True)]]
                last_end = self.i
            elif c in ";&|()" and not self.words_only:
                op = c * 2 if c in ";&|" and self._peek(1) == c else c
                self.i += len(op)
                cur = self._end(done, cur, op)
            else:
                cur.words.append(self._word())
                last_end = self.i
        self._end(done, cur, "\n")
        if self.pending:
            self._fail(f"heredoc <<{self.pending[0][0]} is never closed")
        return done

    def _end(self, done: list[Command], cur: Command, op: str) -> Command:
        if cur.words or cur.heredoc is not None:
            done.append(cur)
        elif cur.sep in ("&&", "||", "|") and op == "\n":
            op = cur.sep  # `a &&` newline `b`: b still follows the &&
        return Command([], self.line, sep=op)

    def _redirect(self, cur: Command) -> None:
        start = self.i
        while self._peek() in ("<", ">", "&") and self._peek():
            self.i += 1
        if self.s[start:self.i] == ">" and self._peek() == "|":
            self.i += 1  # `>|`: noclobber's override, a plain redirect here
        op = self.s[start:self.i]
        if op.startswith("<<") and op != "<<<":
            strip_tabs = self._peek() == "-"
            self.i += strip_tabs
            self._blanks()
            word = self._word()
            self.pending.append(("".join(p.text for p in word), any(p.quoted for p in word),
                                 strip_tabs, cur))
            return
        self._blanks()
        target = self._word()
        if ">" in op and not op.endswith("&"):
            cur.output = target

    def _blanks(self) -> None:
        while self._peek() in (" ", "\t"):
            self.i += 1

    def _read_heredocs(self) -> None:
        for delimiter, quoted, strip_tabs, command in self.pending:
            body = []
            while True:
                if self.i >= len(self.s):
                    self._fail(f"heredoc <<{delimiter} is never closed")
                end = self.s.find("\n", self.i)
                end = len(self.s) if end < 0 else end
                text = self.s[self.i:end]
                self.i, self.line = end + 1, self.line + 1
                if (text.lstrip("\t") if strip_tabs else text) == delimiter:
                    break
                body.append(text.lstrip("\t") if strip_tabs else text)
            text = "".join(line + "\n" for line in body)
            command.heredoc = [Part("lit", text, True)] if quoted else \
                Lexer(text, first_line=command.line + 1)._quoted(None)
        self.pending = []

    def _word(self) -> list[Part]:
        parts: list[Part] = []
        while self.i < len(self.s):
            c = self._peek()
            if c == "(" and not self.words_only and len(parts) == 1 and \
                    parts[0].kind == "lit" and not parts[0].quoted and \
                    ASSIGNMENT.fullmatch(parts[0].text):
                # NAME=( words ), an array (Megatron-LM's own launch scripts build theirs so):
                # its words as bash reads them, comments and newlines included.
                body = self._balanced("(", ")")[1:-1]
                words = [w for command in Lexer(body, first_line=self.line).commands()
                         for w in command.words]
                parts.append(Part("array", "", False, items=words))
                continue
            if c in " \t\r\n" or (not self.words_only and c in ";&|()<>"):
                break
            if c == "\\":
                if self._peek(1) == "\n":
                    self.line += 1
                else:
                    _add(parts, "lit", self._peek(1), True)
                self.i += 2
            elif c == "'":
                end = self.s.find("'", self.i + 1)
                if end < 0:
                    self._fail("a single quote is never closed")
                _add(parts, "lit", self.s[self.i + 1:end], True)
                self.line += self.s.count("\n", self.i, end)
                self.i = end + 1
            elif c == '"':
                self.i += 1
                parts += self._quoted('"')
            elif c in "$`":
                self._expansion(parts, quoted=False)
            else:
                _add(parts, "lit", c, False)
                self.i += 1
        return parts

    def _quoted(self, close: str | None) -> list[Part]:
        """The inside of double quotes (close='"'), or a heredoc body (close=None)."""
        parts: list[Part] = []
        while True:
            if self.i >= len(self.s):
                if close is None:
                    return parts
                self._fail("a double quote is never closed")
            c = self._peek()
            if c == close:
                self.i += 1
                return parts
            # In a heredoc a backslash keeps its meaning before a double quote.
            if c == "\\" and self._peek(1) in ("$", "`", "\\", "\n", close or "$"):
                if self._peek(1) == "\n":
                    self.line += 1
                else:
                    _add(parts, "lit", self._peek(1), True)
                self.i += 2
            elif c in "$`":
                self._expansion(parts, quoted=True)
            else:
                self.line += c == "\n"
                _add(parts, "lit", c, True)
                self.i += 1

    def _expansion(self, parts: list[Part], quoted: bool) -> None:
        if self._peek() == "`":
            end = self.s.find("`", self.i + 1)
            if end < 0:
                self._fail("a backquote is never closed")
            parts.append(Part("cmd", self.s[self.i:end + 1], quoted))
            self.i = end + 1
            return
        self.i += 1  # past $
        c = self._peek()
        if c == "(":
            arith = self._peek(1) == "("
            body = self._balanced("(", ")")
            parts.append(Part("arith", body[2:-2], quoted) if arith
                         else Part("cmd", "$" + body, quoted))
        elif c == "{":
            self._braced(parts, self._balanced("{", "}")[1:-1], quoted)
        elif m := _NAME.match(self.s, self.i):
            parts.append(Part("var", m.group(), quoted))
            self.i = m.end()
        elif c and c in "@*":
            parts.append(Part("var", c, quoted))
            self.i += 1
        elif c and c in "#?$!-0123456789":
            parts.append(Part("cmd", "$" + c, quoted))
            self.i += 1
        else:
            _add(parts, "lit", "$", quoted)

    def _balanced(self, open_: str, close: str) -> str:
        start, depth = self.i, 0
        while self.i < len(self.s):
            c = self._peek()
            if c in "'\"" and open_ == "(":
                end = self.s.find(c, self.i + 1)
                self.i = (end if end > 0 else len(self.s) - 1) + 1
                continue
            depth += (c == open_) - (c == close)
            self.line += c == "\n"
            self.i += 1
            if depth == 0:
                return self.s[start:self.i]
        self._fail(f"{self.s[start:start + 2]!r} is never closed")

    def _braced(self, parts: list[Part], body: str, quoted: bool) -> None:
        m = _NAME.match(body)
        if m and m.end() == len(body):
            parts.append(Part("var", body, quoted))
            return
        if m and body[m.end():] in ("[@]", "[*]"):  # every element of an array
            parts.append(Part("var", m.group(), quoted, op=body[m.end():]))
            return
        op = body[m.end():m.end() + 2] if m else ""
        if m and op[:1] in ("-", "=") or op in (":-", ":="):
            op = op if op.startswith(":") else op[:1]
            parts.append(Part("var", m.group(), quoted,
                              default=Lexer(body[m.end() + len(op):],
                                            first_line=self.line)._quoted(None), op=op))
            return
        parts.append(Part("cmd", "${" + body + "}", quoted))


def _add(parts: list[Part], kind: str, text: str, quoted: bool) -> None:
    if parts and parts[-1].kind == kind == "lit" and parts[-1].quoted == quoted:
        parts[-1].text += text
    else:
        parts.append(Part(kind, text, quoted))


def _divide(a: int, b: int) -> int:
    """Bash's (C's) integer division: toward zero, not Python's floor."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _power(a: int, b: int) -> int:
    if b < 0 or b > 4096:
        raise ValueError("exponent out of range")
    return a ** b


_ARITH_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: _divide, ast.FloorDiv: _divide,
              ast.Mod: lambda a, b: a - b * _divide(a, b), ast.Pow: _power,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def arith(node) -> int:
    if isinstance(node, ast.Expression):
        return arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
        return _ARITH_OPS[type(node.op)](arith(node.left), arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _ARITH_OPS:
        return _ARITH_OPS[type(node.op)](arith(node.operand))
    raise ValueError("not integer arithmetic")
