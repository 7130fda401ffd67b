"""The page `patch --html` and `attribute --html` write: one self-contained file, the answer as JSON
and the explorer's research view (viewer/static/research.js) drawing it, with no server."""

from __future__ import annotations

import base64
import hashlib
import html
from pathlib import Path

from .render import json_for_html, static_file

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="referrer" content="no-referrer">
<title>{title}</title>
<style>
{css}
.layout {{ display: grid; grid-template-columns: minmax(0, 1fr) 380px; gap: 14px; padding: 14px; }}
.research-grid td {{ padding: 0; }}
</style>
</head>
<body>
<div class="layout">
<main id="views"><section id="view-research" class="view glass-research"><h2>{title}</h2></section></main>
<aside id="explain" class="explain" aria-live="polite">
  <div class="explain-head"><h2>Calculation</h2></div>
  <div id="explain-body"><p class="muted">Click any number to see how it was computed.</p></div>
</aside>
</div>
<script type="application/json" id="research-data">{data}</script>
<script>{js}</script>
</body>
</html>
"""


def write_page(path: str | Path, data: dict) -> Path:
    """Write data ({"patch": the patch command's JSON} and/or {"attribute": attribute's}) as a page."""
    js = static_file("research.js")
    digest = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; img-src data:; "
           "connect-src 'none'; base-uri 'none'; form-action 'none'")
    what = "activation patching" if "patch" in data else "direct logit attribution"
    src = data.get("patch") or data.get("attribute")
    title = f"glassformer · {what} · {src.get('checkpoint', '')}"
    page = PAGE.format(csp=csp, title=html.escape(title), css=static_file("glass.css"), data=json_for_html(data), js=js)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(page, encoding="utf-8")
    return p
