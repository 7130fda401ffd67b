"""The limits a chat template renders under, in whatever thread renders it: a time limit, a size
limit on every value it builds, and a budget for all the values of one render
(docs/chat.md#rendering-safely).

Templates ship inside downloaded model folders, so they are untrusted code. jinja2's immutable
sandbox keeps them from reaching Python's internals; this module keeps them from taking the
machine's time and memory, the same way in the main thread, in a worker thread and in the server.

Why this design:

- **Time.** A deadline (`time.monotonic`) read at the points every long render passes through:
  each item of every `{% for %}` loop (the code generator hands each loop's iterable to
  `guard_loop`), every call (macros recurse through calls), every item a filter's iterator yields,
  every piece of output. With every producer of a large value bounded, nothing else a template can
  do runs long between two of those points. A signal timer (what was here before) fires only in
  the main thread, and the server renders in worker threads. A separate process with CPU and memory
  rlimits would hold anywhere too, but costs a process round trip (and a pool of processes per
  server) for every render, against tens of microseconds here (bench/chat_template.py).
- **Size, before allocating.** Each operation that can build a value much larger than its operands
  is checked against an upper bound computed from them, before it runs: `*` (str, bytes, list and
  tuple in either order; integers by their bits, as is `**`), `+`, `%` and `str.format` (widths and
  precisions parsed, `*` widths read from the arguments), `~` and the text of any container (its
  repr, through shared references, measured without being built), the filters that grow text or
  lists (center, indent, replace, join, wordwrap, format, tojson, pprint, batch, slice, sum; round,
  whose negative precision makes a power of ten), the string methods that do (center, ljust,
  rjust, zfill, expandtabs, replace, join, translate, encode; int.to_bytes), `lipsum`, and a
  block's pieces joined (macros, `{% set %}` blocks). No value may pass VALUE_LIMIT characters or
  items; operations that only copy their operands (upper, a slice, split) are checked right after,
  on what they built.
- **Items through every reference.** Lists, tuples and dicts the template writes, and `*`, `+`,
  dict.fromkeys and a batch's or slice's filling, are also refused past VALUE_LIMIT items counted
  through every reference: `{% set ns.t = [ns.t, ns.t] %}` forty times is small, but `==` or
  `hash()` on it would walk 2**40 items in C, where no deadline is read.
- **All values together.** Each value built is charged, by `sys.getsizeof`, to the render's
  MEMORY_LIMIT, so a template cannot keep many values each under the limit (a list grown in a
  namespace, one new string per loop).
- **Compile time.** Jinja folds constant expressions when it compiles, outside any render: the
  filters refuse to run there, so jinja leaves them to render time (binary operators are
  intercepted, so never folded; the sandbox never folds calls).
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import threading
import time
import types
from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from contextlib import contextmanager

TIME_LIMIT_S = 2.0
OUTPUT_LIMIT = 1 << 20  # characters of rendered text
VALUE_LIMIT = OUTPUT_LIMIT  # characters or items of any one value a template builds
MEMORY_LIMIT = 64 << 20  # bytes of all the values one render builds (sys.getsizeof)
INT_BITS = 1 << 16  # bits of an integer a template builds
_FLOAT_DIGITS = 330  # characters a float's digits can add to its width and precision (1e308 in 'f')
_HTML_GROWTH = 6  # Markup escapes each character into at most 6 ('&#39;')


class PastLimit(Exception):
    """A render went past a limit; the message is the user's error."""


class _Render:
    """One render's deadline, the bytes its values took so far, and its {% generation %} tracker."""

    __slots__ = ("deadline", "used", "tracker", "counted")

    def __init__(self, tracker):
        self.deadline, self.used, self.tracker = time.monotonic() + TIME_LIMIT_S, 0, tracker
        self.counted: dict = {}  # id -> (items through every reference, the container: kept, so the id stays its)

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise PastLimit(f"chat template ran past the {TIME_LIMIT_S:g} s limit")


_local = threading.local()  # renders run concurrently, each in its own thread


@contextmanager
def limits(tracker=None):
    """The limits of one render, in this thread, for the `with` block."""
    previous = getattr(_local, "render", None)
    _local.render = state = _Render(tracker)
    try:
        yield state
    finally:
        _local.render = previous


def current() -> _Render | None:
    return getattr(_local, "render", None)


def too_big(what: str) -> PastLimit:
    return PastLimit(f"chat template built a value of more than {VALUE_LIMIT >> 20} MB ({what})")


def bound(size: int, what: str) -> None:
    """Refuse, before it is built, a value of `size` characters or items past VALUE_LIMIT."""
    if size > VALUE_LIMIT:
        raise too_big(what)


def bound_bits(bits: int, what: str) -> None:
    if bits > INT_BITS:
        raise PastLimit(f"chat template built a number of more than {INT_BITS} bits ({what})")


def charge(value, items: bool = False):
    """Count a value just built against the render's limits (its length, the bytes of all values)
    and return it; `items`: a new list's items are new too (a split, a filter's list)."""
    state = getattr(_local, "render", None)
    if state is None:
        return value
    if isinstance(value, (str, bytes, list, tuple, dict)):
        if len(value) > VALUE_LIMIT:
            raise too_big(type(value).__name__)
        state.used += sys.getsizeof(value)
        if items and isinstance(value, (list, tuple)):
            state.used += sum(map(sys.getsizeof, value))
    elif isinstance(value, int) and value.bit_length() > 64:
        bound_bits(value.bit_length(), "a number")
        state.used += sys.getsizeof(value)
    else:
        return value
    if state.used > MEMORY_LIMIT:
        raise PastLimit(f"chat template built more than {MEMORY_LIMIT >> 20} MB of values in one render")
    return value


# ----------------------------------------------------------------------------- measuring unbuilt


def items_through(value) -> int:
    """The items reachable from a list, tuple or dict, counting every reference (a list of 1000
    references to one list of 1000 items holds 1,001,001): what ==, hash() and repr walk through.
    A container is counted once a render (sandboxed templates cannot change one); past VALUE_LIMIT
    the count stops.
    >>> items_through([[1, 2]] * 3)  # the list, then three times the inner list and its two items
    10
    """
    if not isinstance(value, (list, tuple, dict)):
        return 1
    state = current()
    counted = state.counted if state is not None else {}
    return _items_through(value, counted)


def _items_through(value, counted: dict) -> int:
    if not isinstance(value, (list, tuple, dict)):
        return 1
    hit = counted.get(id(value))
    if hit is not None:
        return hit[0]
    total = 1
    for item in (value.values() if isinstance(value, dict) else value):
        total += _items_through(item, counted)
        if total > VALUE_LIMIT:
            total = VALUE_LIMIT + 1
            break
    if isinstance(value, dict) and total <= VALUE_LIMIT:  # keys are hashed: counted too
        total = min(total + sum(_items_through(k, counted) for k in value), VALUE_LIMIT + 1)
    counted[id(value)] = (total, value)
    return total


def built(value):
    """A list, tuple or dict a template wrote ([a, b], (a, b), {k: v}), refused past VALUE_LIMIT
    items through every reference (a tree whose == or hash() would run for hours) and charged."""
    bound(items_through(value), type(value).__name__)
    return charge(value)


class _TooLong(Exception):
    pass


class _Measure:
    """Upper bounds on the length of a value's text (str of it, repr of what it contains) or its
    JSON, found without building it; each container is measured once however often it is
    referenced (a list of 1000 references to one string prints it 1000 times). JSON is counted
    exactly but for integers and an item's separator; past VALUE_LIMIT it stops."""

    def __init__(self, json_: bool = False, indent: int | None = None, item_sep: int = 2, key_sep: int = 2,
                 ascii_: bool = False):
        self.json, self.indent, self.item_sep, self.key_sep, self.ascii = json_, indent, item_sep, key_sep, ascii_
        self.seen: dict = {}

    def size(self, value, depth: int = 0) -> int:
        if isinstance(value, str):
            return self.quoted(value)
        if value is None or isinstance(value, bool):
            return 5
        if isinstance(value, int):
            return value.bit_length() * 41 // 100 + 2  # decimal digits, with room for ',' grouping
        if isinstance(value, float):
            return len(repr(value)) if math.isfinite(value) else 9  # -Infinity in JSON
        if isinstance(value, (bytes, bytearray)):
            return 4 * len(value) + 3
        pairs, items = _contents(value)
        if pairs is None:
            return 200  # another object: its repr does not show contents (a macro, a loop, Undefined)
        key = (id(value), depth if self.indent is not None else 0)
        if key not in self.seen:
            self.seen[key] = 16  # met again inside itself: a cycle, printed as [...]
            self.seen[key] = self.container(pairs, items, depth)
        return self.seen[key]

    def container(self, pairs, items, depth: int) -> int:
        n = len(pairs) + len(items)
        if not self.json:  # brackets, a type name (dict_items(...), <Namespace ...>), ', ' and ': '
            total = 24 + 4 * n
        else:
            total = 2 + max(n - 1, 0) * self.item_sep
            if self.indent is not None and n:  # each item on a line of its own, then the closing line
                total += n * (1 + self.indent * (depth + 1)) + 1 + self.indent * depth
        for k, v in pairs:
            key = self.size(k, depth + 1) + (2 if self.json and not isinstance(k, str) else 0)  # JSON quotes 1 as "1"
            total += key + self.key_sep + self.size(v, depth + 1)
            if total > VALUE_LIMIT:
                raise _TooLong
        for v in items:
            total += self.size(v, depth + 1)
            if total > VALUE_LIMIT:
                raise _TooLong
        return total

    def quoted(self, s: str) -> int:
        """A string in JSON, or in a container's repr: quotes and escapes counted."""
        key = id(s)
        if key not in self.seen:
            markup = 0 if self.json or type(s) is str else 8  # Markup('...')
            if s.isprintable() and not (self.json and self.ascii and not s.isascii()):
                n = len(s) + s.count('"' if self.json else "'") + s.count("\\") + 2  # only these are escaped
            elif len(s) > VALUE_LIMIT:
                n = len(s)  # past the limit however it is escaped
            elif self.json:  # escapes counted exactly, on a copy of at most 6 (12 as ASCII) characters each
                n = len((json.encoder.encode_basestring_ascii if self.ascii else json.encoder.encode_basestring)(s))
            else:
                n = len(repr(s))
            self.seen[key] = n + markup
        return self.seen[key]


def _contents(value):
    """(key-value pairs, items) of a container whose text shows its contents; (None, None) otherwise."""
    if isinstance(value, dict):
        return value.items(), ()
    if isinstance(value, ItemsView):
        return value, ()
    if isinstance(value, (list, tuple, set, frozenset, KeysView, ValuesView)):
        return (), value
    try:  # jinja's namespace prints as <Namespace {its attributes}>
        return object.__getattribute__(value, "_Namespace__attrs").items(), ()
    except (AttributeError, TypeError):
        return None, None


def _measured(measure: _Measure, value) -> int:
    try:
        return measure.size(value)
    except _TooLong:
        return VALUE_LIMIT + 1


def text_len(value) -> int:
    """An upper bound on len(str(value)), without building it (past VALUE_LIMIT: VALUE_LIMIT + 1)."""
    return len(value) if isinstance(value, str) else _measured(_Measure(), value)


def repr_len(value) -> int:
    """An upper bound on len(repr(value))."""
    return _measured(_Measure(), value)


def json_len(value, indent: int | None, item_sep: int, key_sep: int, ascii_: bool) -> int:
    """An upper bound on len(json.dumps(value, ...)) with an indent of `indent` characters."""
    return _measured(_Measure(True, indent, item_sep, key_sep, ascii_), value)


# ----------------------------------------------------------------------------- format strings


def _printf_number(fmt: str, i: int):
    """A printf width or precision at fmt[i:]: ('*' | int | None, the index after it)."""
    if i < len(fmt) and fmt[i] == "*":
        return "*", i + 1
    j = i
    while j < len(fmt) and fmt[j] in "0123456789":
        j += 1
    if j == i:
        return None, i
    return (int(fmt[i:j]) if j - i <= 9 else VALUE_LIMIT + 1), j


def _printf_specs(fmt: str):
    """(mapping key, width, precision, conversion) of each % conversion, read as Python reads them."""
    i, n = 0, len(fmt)
    while (i := fmt.find("%", i)) >= 0:
        i += 1
        key = None
        if i < n and fmt[i] == "(":  # %(name)s, parentheses nesting as Python counts them
            depth, j = 1, i + 1
            while j < n and depth:
                depth += (fmt[j] == "(") - (fmt[j] == ")")
                j += 1
            key, i = fmt[i + 1:j - 1], j
        while i < n and fmt[i] in "-+ #0":
            i += 1
        width, i = _printf_number(fmt, i)
        precision = None
        if i < n and fmt[i] == ".":
            precision, i = _printf_number(fmt, i + 1)
        while i < n and fmt[i] in "hlL":
            i += 1
        yield key, width, precision, fmt[i] if i < n else ""
        i += 1


def printf_len(fmt, right, growth: int = 1) -> int:
    """An upper bound on len(fmt % right): the format's text, each conversion's width and
    precision (`*` ones read from the arguments) and its argument's text (x `growth` when escaped)."""
    if isinstance(fmt, bytes):
        fmt = fmt.decode("latin-1")
    args = right if isinstance(right, tuple) else (right,)
    position, whole, total = 0, None, len(fmt)
    for key, width, precision, conversion in _printf_specs(fmt):
        if conversion == "%":
            continue
        for n in (width, precision):
            if n == "*":
                star, position = (args[position] if position < len(args) else 0), position + 1
                n = abs(star) if isinstance(star, int) else 0
            total += n or 0
        if key is not None:  # a value of the mapping: at most the mapping's whole text
            whole = text_len(right) if whole is None else whole
            arg = whole
        else:
            value, position = (args[position] if position < len(args) else ""), position + 1
            arg = repr_len(value) * (10 if conversion == "a" else 1) if conversion in "ra" else text_len(value)
        total += arg * growth + (_FLOAT_DIGITS if conversion in "eEfFgG" else 0)
        if total > VALUE_LIMIT:
            break
    return total


_DIGITS = re.compile(r"[0-9]+")


def spec_len(value, spec: str) -> int:
    """An upper bound on len(format(value, spec)): every number in the spec (width, precision) plus
    the value's own text (the fill character, spec[0] before an alignment, is skipped)."""
    body = spec[2:] if len(spec) >= 2 and spec[1] in "<>=^" else spec
    numbers = sum(int(d) if len(d) <= 9 else VALUE_LIMIT + 1 for d in _DIGITS.findall(body))
    return numbers + text_len(value) + (_FLOAT_DIGITS if isinstance(value, float) else 0)


# ----------------------------------------------------------------------------- operators and methods


_SEQUENCES = (str, bytes, list, tuple)


def check_binop(operator: str, left, right) -> None:
    """Refuse `left operator right` before Python builds it, when it would pass a limit."""
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            bound_bits(left.bit_length() + right.bit_length(), "*")
        elif isinstance(left, int) and isinstance(right, _SEQUENCES):
            left, right = right, left
        if isinstance(left, _SEQUENCES) and isinstance(right, int):
            bound(len(left) * max(right, 0), "*")
            bound(1 + (items_through(left) - 1) * max(right, 0), "*")
    elif operator == "+":
        if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
            bound(len(left) + len(right), "+")
            bound(items_through(left) + items_through(right) - 1, "+")
    elif operator == "%":
        if isinstance(left, (str, bytes)):
            bound(printf_len(left, right, _HTML_GROWTH if hasattr(left, "__html__") else 1), "%")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            bound_bits(left.bit_length() * right, "**")


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _int(x) -> int:
    return x if isinstance(x, int) else 0


def _len(x) -> int:
    return len(x) if isinstance(x, (str, bytes)) else 0


def _width(s, args, kwargs) -> int:
    return max(len(s), _int(_arg(args, kwargs, 0, "width")))


def _expandtabs(s, args, kwargs) -> int:
    tab = b"\t" if isinstance(s, bytes) else "\t"
    return len(s) + s.count(tab) * max(_int(_arg(args, kwargs, 0, "tabsize", 8)), 0)


def _replace(s, args, kwargs) -> int:
    old, new, count = _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"), _arg(args, kwargs, 2, "count", -1)
    hits = s.count(old) if isinstance(old, type(s)) else len(s) + 1  # '' is found len(s) + 1 times
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(_len(new) - _len(old), 0)


def _join(s, args, kwargs) -> int:
    items = args[0] if args else ()
    return sum(map(_len, items)) + max(len(items) - 1, 0) * len(s)


def _translate(s, args, kwargs) -> int:
    if isinstance(s, bytes):
        return len(s)  # a 256-byte table: one byte each
    table = args[0] if args else None
    if isinstance(table, dict):
        longest = max((_len(v) for v in table.values()), default=1)
    elif isinstance(table, (str, list, tuple)):
        longest = max((_len(v) for v in table), default=1)
    else:
        longest = text_len(table)
    return len(s) * max(longest, 1)


_STR_METHODS = {"center": _width, "ljust": _width, "rjust": _width, "zfill": _width, "expandtabs": _expandtabs,
                "replace": _replace, "join": _join, "translate": _translate,
                "encode": lambda s, args, kwargs: 4 * len(s)}  # utf-32: 4 bytes a character


def check_call(obj, args: tuple, kwargs: dict) -> tuple:
    """Refuse a string method (or int.to_bytes) call whose result would pass the size limit; the
    arguments, with str.join's iterable made a list (it is measured, then joined)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if isinstance(owner, (str, bytes)) and name in _STR_METHODS:
        if name == "join" and args and not isinstance(args[0], (list, tuple)):
            args = (list(args[0]),) + args[1:]
        bound(_STR_METHODS[name](owner, args, kwargs), f"{type(owner).__name__}.{name}")
    elif isinstance(owner, int) and name == "to_bytes":
        bound(_int(_arg(args, kwargs, 0, "length", 1)), "int.to_bytes")
    elif name == "fromkeys" and (owner is dict or isinstance(owner, dict)) and args:  # one value under every key
        keys = args[0] if isinstance(args[0], (list, tuple, dict, str)) else list(args[0])
        args = (keys,) + args[1:]
        bound(1 + len(keys) * (1 + items_through(_arg(args, kwargs, 1, "value"))), "dict.fromkeys")
    return args


def allocates(obj, result, args: tuple, kwargs: dict) -> bool:
    """Whether a call's result is a value it built (charged), not one that existed (dict.get, an argument)."""
    owner = getattr(obj, "__self__", None)
    if result is owner or any(result is a for a in args) or any(result is v for v in kwargs.values()):
        return False
    return not (isinstance(owner, (dict, list, tuple)) and getattr(obj, "__name__", "") not in ("copy", "fromkeys"))


class Guarded:
    """A loop's iterable: the deadline read at each item; its length is the iterable's (loop.length)."""

    __slots__ = ("items", "state")

    def __init__(self, items, state: _Render):
        self.items, self.state = items, state

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        state, clock = self.state, time.monotonic
        for item in self.items:
            if clock() > state.deadline:
                state.check_time()
            yield item


def counted(items, state: _Render):
    """A filter's iterator (map, select, slice, ...): at most VALUE_LIMIT items, the deadline read at each."""
    for n, item in enumerate(items):
        if n == VALUE_LIMIT:
            raise too_big("a filter's items")
        state.check_time()
        yield item


def finalize(value):
    """What {{ value }} prints, a container's text bounded before str() builds it."""
    if type(value) is not str and not isinstance(value, (str, int, float)) and value is not None:
        bound(text_len(value), "{{ }}")
    return value


# ----------------------------------------------------------------------------- filters and globals

# Filters that make text of their value (str() of a container: measured first).
_TEXT_FILTERS = frozenset({"capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower", "replace",
                           "safe", "string", "striptags", "title", "trim", "truncate", "upper", "urlencode", "urlize",
                           "wordcount", "wordwrap", "xmlattr"})
# Filters that return a value that already existed (not charged again).
_ITEM_FILTERS = frozenset({"attr", "d", "default", "first", "last", "max", "min", "random"})


def _f_center(value, width=80, *_, **__):
    bound(max(text_len(value), _int(width)), "center")


def _f_indent(s, width=4, *_, **__):
    text = text_len(s)
    lines = s.count("\n") + 2 if isinstance(s, str) else text + 2
    indent = len(width) if isinstance(width, str) else max(_int(width), 0)
    bound(indent, "indent")  # " " * width comes first
    bound(text + lines * indent, "indent")


def _f_replace(s, old, new, count=None, *_, **__):
    if isinstance(s, str) and isinstance(old, str):
        hits = s.count(old)
    else:
        hits = text_len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    bound(text_len(s) + hits * max(text_len(new) - _len(old), 0), "replace")


def _f_join(value, d="", *_, **__):
    items = value if isinstance(value, (list, tuple)) else list(value)
    total = max(len(items) - 1, 0) * text_len(d)
    for item in items:
        total += text_len(item)
        if total > VALUE_LIMIT:
            break
    bound(total, "join")
    return items


def _f_format(value, *args, **kwargs):
    text = value if isinstance(value, str) else str(value)  # measured already (a text filter)
    bound(printf_len(text, kwargs or args, _HTML_GROWTH if hasattr(text, "__html__") else 1), "format")
    return text


def _f_wordwrap(s, width=79, break_long_words=True, wrapstring=None, *_, **__):
    if isinstance(s, str) and isinstance(wrapstring, str) and len(wrapstring) > 1:  # a line is at least a character
        bound(len(s) + (len(s) + 1) * len(wrapstring), "wordwrap")


def _f_pprint(value, *_, **__):
    n = repr_len(value)  # a line per item at most, each indented by at most the whole text
    bound(n + n * (n + 80), "pprint")


def _f_batch(value, linecount, fill_with=None, *_, **__):
    if fill_with is not None:  # the last batch filled up to linecount with it
        bound(_int(linecount) * items_through(fill_with), "batch")


def _f_slice(value, slices, fill_with=None, *_, **__):
    bound(_int(slices) * (1 + (items_through(fill_with) if fill_with is not None else 0)), "slice")


def _f_sum(iterable, attribute=None, start=0, *_, **__):
    items = iterable if isinstance(iterable, (list, tuple)) else list(iterable)
    if attribute is None and isinstance(start, (int, float)) and all(isinstance(x, (int, float)) for x in items):
        return items
    total = text_len(start)
    for item in items:  # sequences added one by one: each sum copies all before it
        total += text_len(item)
        if total > VALUE_LIMIT:
            break
    bound(total, "sum")
    bound(total * len(items) // 16, "sum")
    return items


def _f_round(value, precision=0, *_, **__):
    if isinstance(value, int) and isinstance(precision, int) and precision < 0:  # round(5, -n) makes 10 ** n
        bound_bits(-precision * 10 // 3, "round")


_FILTER_CHECKS = {"round": _f_round, "center": _f_center, "indent": _f_indent, "replace": _f_replace, "join": _f_join,
                  "format": _f_format, "wordwrap": _f_wordwrap, "pprint": _f_pprint, "batch": _f_batch,
                  "slice": _f_slice, "sum": _f_sum}


def _bounded_filter(name: str, func):
    """`func` with its value's text measured (text filters), its check run first (a value it
    returns replaces the filter's value: an iterator made a list), its result charged, and the
    iterator it returns counted; outside a render (compile-time folding) it refuses to run."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # the context or environment first
    check, text, keep = _FILTER_CHECKS.get(name), name in _TEXT_FILTERS, name in _ITEM_FILTERS

    def filtered(*args, **kwargs):
        state = current()
        if state is None:
            raise PastLimit("a filter runs only inside a render")
        value = args[skip] if len(args) > skip else None
        if text and not isinstance(value, str):
            bound(text_len(value), name)
        if check is not None and len(args) > skip:
            checked = check(*args[skip:], **kwargs)
            if checked is not None:
                args = args[:skip] + (checked,) + args[skip + 1:]
        result = func(*args, **kwargs)
        if type(result) is str:  # most filters: text
            return result if result is value else charge(result)
        if isinstance(result, Iterator):
            return counted(result, state)
        return result if keep or result is value else charge(result, items=True)

    return functools.update_wrapper(filtered, func)


def bounded_filters(filters: dict) -> dict:
    return {name: _bounded_filter(name, func) for name, func in filters.items()}


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """JSON as transformers' templates get it (jinja's own tojson escapes HTML characters), its
    length bounded before it is built."""
    width = (len(indent) if isinstance(indent, str) else max(_int(indent), 0)) if indent is not None else None
    bound(width or 0, "tojson indent")  # json makes ' ' * indent before anything else
    item_sep, key_sep = separators if separators is not None else ("," if indent is not None else ", ", ": ")
    bound(json_len(x, width, text_len(item_sep), text_len(key_sep), bool(ensure_ascii)), "tojson")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 (jinja's names)
    """jinja's lorem ipsum, refused past the size limit (about 20 characters a word)."""
    from jinja2.utils import generate_lorem_ipsum

    bound(_int(n) * (_int(max) + 1) * 20 if _int(n) > 0 and _int(max) > 0 else 0, "lipsum")
    return generate_lorem_ipsum(n, html, min, max)


# ----------------------------------------------------------------------------- the environment


@functools.lru_cache(maxsize=1)
def sandbox_class():
    """jinja2's ImmutableSandboxedEnvironment with every producer of large values bounded, the
    deadline read in every loop and call, and every value built charged (see the module's docstring)."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedCode(CodeGenerator):
        """jinja's code, with each loop's iterable handed to environment.guard_loop, each `~`'s
        operands to environment.tilde, each slice to environment.sliced and each list, tuple and dict
        it writes to environment.built."""

        def visit_For(self, node, frame):
            guarded = nodes.Call(nodes.EnvironmentAttribute("guard_loop"), [node.iter], [], None, None,
                                 lineno=node.lineno)
            super().visit_For(nodes.For(node.target, guarded, node.body, node.else_, node.test, node.recursive,
                                        lineno=node.lineno, environment=node.environment), frame)

        def visit_Getitem(self, node, frame):
            if not isinstance(node.arg, nodes.Slice):
                return super().visit_Getitem(node, frame)
            self.write("environment.sliced(")
            super().visit_Getitem(node, frame)
            self.write(")")

        def visit_List(self, node, frame):
            self.built(super().visit_List, node, frame)

        def visit_Dict(self, node, frame):
            self.built(super().visit_Dict, node, frame)

        def visit_Tuple(self, node, frame):
            if node.ctx != "load":  # a target: {% for a, b in ... %}
                return super().visit_Tuple(node, frame)
            self.built(super().visit_Tuple, node, frame)

        def built(self, visit, node, frame):
            try:  # a literal of constants is no bigger than the template's source
                node.as_const(frame.eval_ctx)
                return visit(node, frame)
            except nodes.Impossible:
                pass
            self.write("environment.built(")
            visit(node, frame)
            self.write(")")

        def visit_Concat(self, node, frame):
            if frame.eval_ctx.volatile:  # the joins jinja's own visit_Concat picks
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"environment.tilde({join}, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    return _sandbox(ImmutableSandboxedEnvironment, LimitedCode)


def _sandbox(base, code_generator):
    from markupsafe import Markup

    class Sandbox(base):
        code_generator_class = code_generator
        intercepted_binops = frozenset({"+", "*", "%", "**"})

        def __init__(self, **options):
            super().__init__(finalize=finalize, **options)
            self.filters = bounded_filters({**self.filters, "tojson": tojson})
            self.globals["lipsum"] = lipsum

        def guard_loop(self, iterable):
            state = current()
            return iterable if state is None else Guarded(iterable, state)

        def tilde(self, join, parts):
            bound(sum(len(p) if type(p) is str else text_len(p) for p in parts), "~")
            return charge(join(parts))

        @staticmethod
        def concat(parts):  # environment.concat: the pieces of a macro, a {% set %} block, a filter block
            parts = parts if isinstance(parts, list) else list(parts)
            bound(sum(map(len, parts)), "a block's text")
            return charge("".join(parts))

        def call_binop(self, context, operator, left, right):
            if operator == "+" and type(left) is str and type(right) is str:  # most of what templates do, kept short
                if len(left) + len(right) > VALUE_LIMIT:
                    raise too_big("+")
                result, state = left + right, getattr(_local, "render", None)
                if state is not None:
                    state.used += sys.getsizeof(result)
                    if state.used > MEMORY_LIMIT:
                        charge(result)  # raises
                return result
            check_binop(operator, left, right)
            return charge(self.binop_table[operator](left, right))

        def sliced(self, value):  # x[a:b] copies (jinja slices without getitem)
            return charge(value)

        built = staticmethod(built)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            state = current()
            if state is not None:
                state.check_time()
            args = check_call(__obj, args, kwargs)
            result = super().call(__context, __obj, *args, **kwargs)
            return charge(result, items=True) if allocates(__obj, result, args, kwargs) else result

        def wrap_str_format(self, value):
            return _bounded_format(self, value, Markup)

    return Sandbox


def _bounded_format(env, value, markup):
    """str.format / format_map of a string, as the sandbox wraps them, with each field's width,
    precision and text counted before it is formatted."""
    if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or value.__name__ not in ("format", "format_map"):
        return None
    owner = value.__self__
    if not isinstance(owner, str):
        return None
    formatter = _formatter_class(isinstance(owner, markup))(env, **({"escape": owner.escape} if isinstance(owner, markup) else {}))
    is_map = value.__name__ == "format_map"

    def formatted(*args, **kwargs):
        if is_map:
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one argument and no keyword arguments")
            args, kwargs = (), args[0]
        return type(owner)(formatter.vformat(owner, args, kwargs))

    return functools.update_wrapper(formatted, value)


@functools.lru_cache(maxsize=2)
def _formatter_class(escaping: bool):
    from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter

    class Counting:
        growth = _HTML_GROWTH if escaping else 1

        def vformat(self, format_string, args, kwargs):
            self.made = len(format_string)
            return super().vformat(format_string, args, kwargs)

        def convert_field(self, value, conversion):
            if conversion in ("r", "a"):
                bound(repr_len(value) * (10 if conversion == "a" else 1), "str.format")
            elif conversion is not None:
                bound(text_len(value), "str.format")
            return super().convert_field(value, conversion)

        def format_field(self, value, format_spec):
            self.made += spec_len(value, format_spec) * self.growth
            bound(self.made, "str.format")
            return super().format_field(value, format_spec)

    return type("BoundedFormatter", (Counting, SandboxedEscapeFormatter if escaping else SandboxedFormatter), {})
