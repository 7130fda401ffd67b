"""The explorer: a page that shows a model's computation number by number.

`render` turns a trace into a page (one self-contained HTML file, or the server's page);
`server` is the small local server behind `glassformer view`. The page itself is plain
HTML/CSS/JS in static/ and reads trace JSON only.
"""

from .render import build_payload, render_html, write_html

__all__ = ["build_payload", "render_html", "write_html"]
