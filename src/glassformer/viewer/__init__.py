"""The explorer: a page that shows a model's computation number by number.

`render` turns a trace into a page (one self-contained HTML file, or the server's page);
`server` is the small local server behind `glassformer view`; `source` traces a model for
the page. The page itself is plain HTML/CSS/JS in static/ and reads trace JSON only.
"""

from __future__ import annotations

from .render import build_payload, render_html, write_html
from .source import write_trace_page, write_worked_page


def write_trace_html(trace, path, model=None, tokenizer=None, sentence=None):
    """`glassformer trace --html`: the page of one trace as a self-contained file."""
    return write_trace_page(trace, path, model=model, tokenizer=tokenizer, sentence=sentence)


def write_worked_html(path, text=None):
    """`glassformer worked --html`: the walkthrough's toy model on 'I like cats too'."""
    return write_worked_page(path, text)


__all__ = ["build_payload", "render_html", "write_html", "write_trace_html", "write_worked_html"]
