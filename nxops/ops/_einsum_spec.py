"""Parsing of named einsum specs (``'n<b,k>,<k,m>->n<b,m>'``).

Grammar: operand terms separated by ``,``, then ``->`` and the result term
(optional: without it the result is what ``np.einsum`` would give, plus the
names that occur in exactly one operand). A term is positional letters (one
per positional dim, ``...`` for any number of leading/middle dims) and at most
one named group ``<a,b>`` or ``{a,b}`` anywhere in it. Names are Python
identifiers; their order inside a group does not matter. Whitespace is ignored.

Errors quote the spec and point at the offending character.
"""
from __future__ import annotations

import dataclasses
import functools

from nxops._errors import NxopsError

ELLIPSIS = "..."
_CLOSING = {"<": ">", "{": "}"}


@dataclasses.dataclass(frozen=True)
class Term:
    """One operand or the result: positional labels (letters or ``...``) and names."""

    positional: tuple[str, ...]
    names: tuple[str, ...]

    @property
    def has_ellipsis(self) -> bool:
        return ELLIPSIS in self.positional

    @property
    def letters(self) -> tuple[str, ...]:
        return tuple(p for p in self.positional if p != ELLIPSIS)


@dataclasses.dataclass(frozen=True)
class EinsumSpec:
    text: str
    inputs: tuple[Term, ...]
    output: Term


def _error(text: str, pos: int, why: str, fix: str = "") -> NxopsError:
    pointer = " " * pos + "^"
    message = f"invalid einsum spec: {why}\n    {text}\n    {pointer}"
    if fix:
        message += f"\n{fix}"
    return NxopsError(message)


def _parse_names(text: str, start: int, end: int) -> tuple[str, ...]:
    """Names between the brackets at ``start`` and ``end`` (exclusive)."""
    names: list[str] = []
    pos = start
    for raw in text[start:end].split(","):
        name = raw.strip()
        offset = pos + (len(raw) - len(raw.lstrip()))
        if not name:
            if raw or text[start:end].strip():
                raise _error(text, offset, "empty name in a named group",
                             "Separate names with single commas, e.g. <a,b>.")
        elif not name.isidentifier():
            raise _error(text, offset, f"{name!r} is not a valid axis name",
                         "Names are identifiers such as 'batch' or 'k'.")
        elif name in names:
            raise _error(text, offset, f"name {name!r} appears twice in one group")
        else:
            names.append(name)
        pos += len(raw) + 1
    return tuple(names)


def _parse_term(text: str, start: int, end: int, *, is_output: bool) -> Term:
    positional: list[str] = []
    names: tuple[str, ...] | None = None
    pos = start
    while pos < end:
        char = text[pos]
        if char.isspace():
            pos += 1
        elif text.startswith(ELLIPSIS, pos):
            if ELLIPSIS in positional:
                raise _error(text, pos, "'...' appears twice in one term")
            positional.append(ELLIPSIS)
            pos += len(ELLIPSIS)
        elif char in _CLOSING:
            close = text.find(_CLOSING[char], pos + 1, end)
            if close < 0:
                raise _error(text, pos, f"unclosed named group {char!r}",
                             f"Close it with {_CLOSING[char]!r}.")
            if names is not None:
                raise _error(text, pos, "a term has at most one named group",
                             "Put all names of this operand in one group, e.g. <a,b>.")
            names = _parse_names(text, pos + 1, close)
            pos = close + 1
        elif char.isalpha() and char.isascii():
            if char in positional and is_output:
                raise _error(text, pos, f"letter {char!r} appears twice in the result")
            positional.append(char)
            pos += 1
        else:
            raise _error(text, pos, f"unexpected character {char!r}",
                         "Terms hold letters (positional dims), '...', and one group "
                         "<names> or {names}; terms are separated by ',' and '->'.")
    return Term(tuple(positional), names or ())


def _implicit_output(inputs: tuple[Term, ...]) -> Term:
    letters = [c for t in inputs for c in t.letters]
    names = [n for t in inputs for n in t.names]
    single_letters = sorted(c for c in set(letters) if letters.count(c) == 1)
    single_names = [n for n in dict.fromkeys(names) if names.count(n) == 1]
    ellipsis = (ELLIPSIS,) if any(t.has_ellipsis for t in inputs) else ()
    return Term(ellipsis + tuple(single_letters), tuple(single_names))


@functools.lru_cache(maxsize=512)
def parse_einsum_spec(text: str) -> EinsumSpec:
    """Parses ``text`` once (cached); raises NxopsError pointing at the bad part."""
    if not isinstance(text, str):
        raise NxopsError(f"nx.einsum: the spec must be a string, got {text!r}.")
    arrow = text.find("->")
    if arrow >= 0 and text.find("->", arrow + 2) >= 0:
        raise _error(text, text.find("->", arrow + 2), "'->' appears twice")
    inputs_end = arrow if arrow >= 0 else len(text)
    inputs: list[Term] = []
    start = 0
    depth_open = None
    for pos in range(inputs_end + 1):
        char = text[pos] if pos < inputs_end else ","
        if char in _CLOSING:
            depth_open = char
        elif depth_open and char == _CLOSING[depth_open]:
            depth_open = None
        elif char == "," and depth_open is None:
            inputs.append(_parse_term(text, start, pos, is_output=False))
            start = pos + 1
    if depth_open is not None:
        raise _error(text, text.rfind(depth_open, 0, inputs_end), f"unclosed named group {depth_open!r}")
    output = (_parse_term(text, arrow + 2, len(text), is_output=True) if arrow >= 0
              else _implicit_output(tuple(inputs)))
    spec = EinsumSpec(text, tuple(inputs), output)
    _check_output(spec, arrow)
    _check_letters_are_not_names(spec)
    return spec


def _outside_groups(text: str) -> list[int]:
    """Positions of the characters of ``text`` that are not inside a group."""
    positions, closing = [], None
    for pos, char in enumerate(text):
        if closing is None and char in _CLOSING:
            closing = _CLOSING[char]
        elif closing is not None and char == closing:
            closing = None
        elif closing is None:
            positions.append(pos)
    return positions


def _check_letters_are_not_names(spec: EinsumSpec) -> None:
    """A name spelled like a positional letter ('<b>b->') gives two axes one
    spelling, which reads as one axis: refuse, with the spec renamed apart."""
    text = spec.text
    names = {n for t in (*spec.inputs, spec.output) for n in t.names}
    letters = {c for t in (*spec.inputs, spec.output) for c in t.letters}
    clash = sorted(names & letters)
    if not clash:
        return
    letter = clash[0]
    outside = [p for p in _outside_groups(text) if text[p] == letter]
    free = next(c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                if c not in letters and c not in names)
    renamed = "".join(free if p in outside else c for p, c in enumerate(text))
    raise _error(text, outside[0], f"{letter!r} is both a positional letter and a name in a "
                 f"group (<{letter}>)",
                 f"A letter is a positional dim and a name in <...> a named axis; give them "
                 f"different spellings, e.g. {renamed!r}.")


def _check_output(spec: EinsumSpec, arrow: int) -> None:
    text = spec.text
    in_letters = {c for t in spec.inputs for c in t.letters}
    in_names = {n for t in spec.inputs for n in t.names}
    for letter in spec.output.letters:
        if letter not in in_letters:
            raise _error(text, text.index(letter, arrow), f"result letter {letter!r} is in no operand",
                         "Every letter of the result must occur in an operand.")
    for name in spec.output.names:
        if name not in in_names:
            raise _error(text, text.index(name, arrow), f"result name {name!r} is in no operand",
                         "A name in the result must occur in an operand (names only in "
                         "operands are contracted).")
    if spec.output.has_ellipsis and not any(t.has_ellipsis for t in spec.inputs):
        raise _error(text, text.index(ELLIPSIS, arrow), "'...' in the result but in no operand")


def term_text(term: Term) -> str:
    names = f"<{','.join(term.names)}>" if term.names else ""
    return "".join(term.positional) + names


@functools.lru_cache(maxsize=512)
def omitted_groups(spec: EinsumSpec) -> dict[str, str]:
    """``{name: spec}`` for each contracted name that some operand's group
    omits: that operand is not summed over it (docs/xmap.md), which readers
    of lax.xeinsum specs easily miss; the spec with the name on every operand."""
    contracted = [n for n in dict.fromkeys(n for t in spec.inputs for n in t.names)
                  if n not in spec.output.names]
    fixes = {}
    for name in contracted:
        if all(name in t.names for t in spec.inputs):
            continue
        terms = [t if name in t.names else Term(t.positional, t.names + (name,))
                 for t in spec.inputs]
        fixes[name] = ",".join(map(term_text, terms)) + "->" + term_text(spec.output)
    return fixes
