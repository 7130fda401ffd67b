"""Chat template limits hold wherever rendering runs (docs/chat.md#rendering-safely): each template
found to run for minutes or build gigabytes is refused with its limit's one-line error, well within
ten times the time limit and without the big allocation, in the main thread, in a thread and in a
thread pool (what the server renders in), and through the server's own path as a 400. Templates
under the limits render as before, concurrent renders keep their own limits."""

from __future__ import annotations

import json
import re
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest

from glassformer.text.chat_template import CHATML_TEMPLATE, TemplateError, render
from glassformer.text.template_limits import MEMORY_LIMIT, TIME_LIMIT_S, VALUE_LIMIT

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "to be"}]
WAIT_S = 10 * TIME_LIMIT_S  # a refusal comes well before this (the reproductions ran for minutes)
SMALL_PEAK = 16 << 20  # bytes traced during a refused render (the reproductions took 0.3-1.4 GB)
TIME = r"^chat template ran past the 2 s limit$"
MEMORY = rf"^chat template built more than {MEMORY_LIMIT >> 20} MB of values in one render$"
S = "{% set s = 'x' * 1000000 %}"  # a string just under the size limit
LIST = S + "{% set l = [s] * 1000 %}"  # 1000 references to it: a small list whose text is 1 GB


def size(what: str) -> str:
    return rf"^chat template built a value of more than 1 MB \({what}\)$"


# The issue's reproductions: (template, the limit's message).
ISSUE = {
    "nested loops": ("{% set s='x'*100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", TIME),
    "lipsum": ("{{ lipsum(1000000)|length }}", size("lipsum")),
    "tuple product": ("{{ ((1,)*50000000)|length }}", size(r"\*")),
    "printf width": ("{{ ('%0300000000d' % 1)|length }}", size("%")),
    "center": ("{{ (''|center(300000000))|length }}", size("center")),
    "str.format width": ("{{ '{:>300000000}'.format('x')|length }}", size(r"str\.format")),
    "tojson indent": ("{{ messages|tojson(indent=50000000)|length }}", size("tojson indent")),
    "replace": ("{{ (('x'*1000)|replace('x', 'y'*1000)|replace('y', 'z'*1000))|length }}", size("replace")),
    "join a tuple": ("{{ ((('x'*1000000),)*1000)|join|length }}", size("join")),
    "join a list": (S + "{{ [s, s, s, s, s, s, s, s]|join|length }}", size("join")),
    "~ doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                   "{{ ns.s|length }}", size("~")),
}
# Their kin: the same doors, other handles.
KIN = {
    "+ doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
                   "{{ ns.s|length }}", size(r"\+")),
    "list product, number first": ("{{ (50000000 * [1])|length }}", size(r"\*")),
    "printf * width": ("{{ ('%*d' % (300000000, 1))|length }}", size("%")),
    "printf mapping reused": ("{{ ('%(a)s%(a)s%(a)s' % {'a': 'x' * 500000})|length }}", size("%")),
    "str.format nested width": ("{{ '{:{}}'.format('x', 300000000)|length }}", size(r"str\.format")),
    "format filter": ("{{ ('%s' * 1000)|format(*(['x' * 10000] * 1000))|length }}", size("format")),
    "str.ljust": ("{{ 'x'.ljust(300000000)|length }}", size(r"str\.ljust")),
    "str.zfill": ("{{ 'x'.zfill(300000000)|length }}", size(r"str\.zfill")),
    "str.expandtabs": ("{{ ('\t' * 1000).expandtabs(1000000)|length }}", size(r"str\.expandtabs")),
    "str.join": (S + "{{ ''.join([s] * 1000)|length }}", size(r"str\.join")),
    "str.replace": (S + "{{ s.replace('x', 'yy')|length }}", size(r"str\.replace")),
    "str.encode": (S + "{{ s.encode('utf-32')|length }}", size(r"str\.encode")),
    "Markup.center": ("{{ ('x'|safe).center(300000000)|length }}", size(r"Markup\.center")),
    "int.to_bytes": ("{{ (1).to_bytes(300000000, 'big')|length }}", size(r"int\.to_bytes")),
    "number squaring": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}"
                        "{{ ns.n > 0 }}", r"^chat template built a number of more than 65536 bits \(\*\)$"),
    "power": ("{{ 7 ** 1000000 > 1 }}", r"^chat template built a number of more than 65536 bits \(\*\*\)$"),
    "round": ("{{ 5|round(-1000000000) }}", r"^chat template built a number of more than 65536 bits \(round\)$"),
    "printed shared list": (LIST + "{{ l }}", size("{{ }}")),
    "string filter": (LIST + "{{ l|string|length }}", size("string")),
    "~ of a list": (LIST + "{{ (l ~ '')|length }}", size("~")),
    "tojson of a list": (LIST + "{{ l|tojson|length }}", size("tojson")),
    "printf of a list": (LIST + "{{ ('%s' % [l])|length }}", size("%")),
    "str.format of a list": (LIST + "{{ '{!r}'.format(l)|length }}", size(r"str\.format")),
    "upper of a list": (LIST + "{{ l|upper|length }}", size("upper")),
    "pprint": (LIST + "{{ l|pprint|length }}", size("pprint")),
    "== of doubled trees": ("{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(40) %}{% set ns.a = [ns.a, ns.a] %}"
                            "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}", size("list")),
    "hash of a doubled tuple": ("{% set ns = namespace(t=(1,)) %}{% for i in range(60) %}{% set ns.t = (ns.t, ns.t) %}"
                                "{% endfor %}{{ {ns.t: 1}|length }}", size("tuple")),
    "+ of a list and itself": ("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l] + [ns.l] %}"
                               "{% endfor %}{{ ns.l|length }}", size(r"\+")),
    "dict.fromkeys": ("{% set ns = namespace(d=[1]) %}{% for i in range(40) %}{% set ns.d = {}.fromkeys([1, 2], ns.d) %}"
                      "{% endfor %}{{ ns.d|length }}", size(r"dict\.fromkeys")),
    "macro output": (S + "{% macro m() %}{% for i in range(1000) %}{{ s }}{% endfor %}{% endmacro %}{{ m()|length }}",
                     size("a block's text")),
    "indent": ("{{ 'x'|indent(300000000, true)|length }}", size("indent")),
    "wordwrap": (S + "{{ s|wordwrap(5, wrapstring='y' * 100)|length }}", size("wordwrap")),
    "batch": ("{{ [1]|batch(300000000, 'x')|list|length }}", size("batch")),
    "slice": ("{{ [1]|slice(300000000)|list|length }}", size("slice")),
    "sum": (S + "{{ ([[s]] * 100000)|sum(start=[])|length }}", size("sum")),
    "strftime_now": ("{{ strftime_now('%Y' * 100000)|length }}", size("strftime_now")),
    "values kept in a namespace": (S + "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                                   "{% set ns.l = ns.l + [s ~ i] %}{% endfor %}{{ ns.l|length }}", MEMORY),
    "slices kept": (S + "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                    "{% set ns.l = ns.l + [s[i:]] %}{% endfor %}{{ ns.l|length }}", MEMORY),
    "set blocks kept": (S + "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set x %}{{ s }}{{ i }}{% endset %}"
                        "{% set ns.l = ns.l + [x] %}{% endfor %}{{ ns.l|length }}", MEMORY),
    "macro recursion": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}", TIME),
    "nested ranges": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", TIME),
}


def rendered_in(runner: str, template: str) -> tuple[TemplateError | None, float, int]:
    """render(template) in the main thread, a new thread or a thread pool's worker: (the
    TemplateError raised, seconds it took, peak bytes Python allocated meanwhile)."""
    def attempt():
        t0 = time.monotonic()
        try:
            render(template, MESSAGES)
        except TemplateError as e:
            return e, time.monotonic() - t0
        return None, time.monotonic() - t0

    tracemalloc.start()
    try:
        if runner == "main":
            got = attempt()
        elif runner == "thread":
            box: list = []
            worker = threading.Thread(target=lambda: box.append(attempt()), daemon=True)
            worker.start()
            worker.join(WAIT_S)
            assert box, f"the render still ran after {WAIT_S:g} s"
            got = box[0]
        else:
            pool = ThreadPoolExecutor(1)
            try:
                got = pool.submit(attempt).result(timeout=WAIT_S)
            finally:
                pool.shutdown(wait=False)
        return (*got, tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def check_refused(runner: str, template: str, message: str) -> None:
    error, seconds, peak = rendered_in(runner, template)
    assert error is not None, "the template rendered"
    assert "\n" not in str(error) and re.match(message, str(error)), str(error)
    assert seconds < WAIT_S
    assert peak < (MEMORY_LIMIT + SMALL_PEAK if message == MEMORY else SMALL_PEAK), f"{peak >> 20} MB"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("runner", ["main", "thread", "pool"])
@pytest.mark.parametrize("name", list(ISSUE))
def test_the_issues_templates_are_refused_in_any_thread(name, runner):
    check_refused(runner, *ISSUE[name])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(KIN))
def test_their_kin_are_refused_in_a_worker_thread(name):
    check_refused("pool", *KIN[name])


def test_values_under_the_limits_still_render():
    text = "line one\n\tsays \"hi\" \\ to é東京🙂\x01" * 20000  # escapes counted exactly: about 880k of JSON
    assert len(json.dumps(text, ensure_ascii=False)) < VALUE_LIMIT < len(json.dumps(text, ensure_ascii=False)) * 6
    cases = {
        "{{ ('x' * 1000000)|length }}": "1000000",
        "{{ 'ab' * 3 }}|{{ 3 * [1] }}|{{ (1, 2) + (3,) }}": "ababab|[1, 1, 1]|(1, 2, 3)",
        "{{ '%05d|%-4s|%.2f' % (3, 'x', 2.5) }}": "00003|x   |2.50",
        "{{ '%(a)s-%(a)s' % {'a': 1} }}|{{ '{:>5}|{:{}}|{!r}'.format('x', 'y', 3, 'z') }}": "1-1|    x|y  |'z'",
        "{{ 'ab'|center(6) }}|{{ 'a\nb'|indent(2) }}|{{ 'aaa'|replace('a', 'bb', 2) }}": "  ab  |a\n  b|bbbba",
        "{{ [1, 2]|sum }}|{{ [[1], [2]]|sum(start=[]) }}|{{ [1, 2, 3]|batch(2, 0)|list }}": "3|[1, 2]|[[1, 2], [3, 0]]",
        "{{ range(3)|length }}|{% for x in [1, 2, 3]|select('odd') %}{{ loop.length }}{% endfor %}": "3|22",
        "{{ (2 ** 64) * (2 ** 64) }}|{{ 'a-b'.split('-')|join(',') }}|{{ 'x'.zfill(3) }}|{{ 1234|round(-2) }}":
            f"{2 ** 128}|a,b|00x|1200",
        "{% set ns = namespace(x=1) %}{% set ns.x = ns %}{{ ns }}": "<Namespace {'x': <Namespace {...}>}>",
        "{% for a, b in [(1, 2), (3, 4)] %}{{ a }}{{ b }}{% endfor %}{% set x, y = 5, [6] %}{{ x }}{{ y }}": "12345[6]",
        "{{ [messages, messages] == [messages, messages] }}|{{ {(1, 2): 'a'}[(1, 2)] }}": "True|a",
    }
    for template, expected in cases.items():
        assert render(template, []) == expected, template
    assert render("{{ t|tojson }}", [], t=text) == json.dumps(text, ensure_ascii=False)
    assert render("{{ m|tojson(indent=2) }}", [], m=MESSAGES) == json.dumps(MESSAGES, indent=2, ensure_ascii=False)
    assert render("{{ m|tojson(ensure_ascii=true, separators=(',', ':')) }}", [], m={"a": "東"}) == '{"a":"\\u6771"}'
    assert len(render("{{ lipsum(2, false, 5, 10) }}", [])) > 0
    assert render("{{ t|pprint }}", [], t={"a": [1, 2]}) == "{'a': [1, 2]}"


@pytest.mark.timeout(60)
def test_concurrent_renders_keep_their_own_limits():
    """A render past its time limit in one thread leaves a normal render in another untouched."""
    pool = ThreadPoolExecutor(2)
    try:
        slow = pool.submit(rendered_in, "main", ISSUE["nested loops"][0])
        expected = render(CHATML_TEMPLATE, MESSAGES, add_generation_prompt=True)
        results = [pool.submit(render, CHATML_TEMPLATE, MESSAGES, add_generation_prompt=True) for _ in range(50)]
        assert all(r.result(timeout=WAIT_S) == expected for r in results)
        error, _, _ = slow.result(timeout=WAIT_S)
        assert error is not None and str(error) == "chat template ran past the 2 s limit"
    finally:
        pool.shutdown(wait=False)


@pytest.mark.timeout(120)
def test_the_server_answers_a_template_past_its_limits_with_a_400():
    from starlette.testclient import TestClient

    from glassformer.serve.backend import Backend
    from glassformer.serve.http import make_app
    from glassformer.serve.openai import add_routes, openai_error

    from ..serve.served import tokenizer
    from ..support import tiny_model

    tok = tokenizer()
    hostile = ISSUE["nested loops"][0]
    backend = Backend("m").ready(None, tiny_model(vocab_size=tok.vocab_size), tok, template=hostile)
    app = add_routes(make_app(host="127.0.0.1", port=0, error_body=openai_error), backend)
    with TestClient(app, base_url="http://127.0.0.1") as client:  # rendered in the server's worker threads
        t0 = time.monotonic()
        got = client.post("/tokenize", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert time.monotonic() - t0 < WAIT_S
        assert got.status_code == 400
        assert got.json()["error"]["message"] == "chat template ran past the 2 s limit"
        backend.template = None  # the tokenizer's own ChatML: the same server renders it
        ok = client.post("/tokenize", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200 and ok.json()["tokens"] == tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True)
