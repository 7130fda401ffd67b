"""The SAE feature browser as one self-contained page: `sae features --html` (docs/research.md#sparse-autoencoders).

The report (research.sae.feature_report) goes into the page as JSON; static/features.js draws it.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

STATIC = Path(__file__).resolve().parent / "static"

_CSS = """
body { font-family: system-ui, sans-serif; margin: 0; display: flex; flex-direction: column; height: 100vh; }
#feature-header { padding: 8px 12px; border-bottom: 1px solid #ccc; font-size: 14px; }
main { display: flex; flex: 1; min-height: 0; }
#side { width: 260px; border-right: 1px solid #ccc; display: flex; flex-direction: column; }
#feature-filter { margin: 6px; }
#feature-list { overflow-y: auto; flex: 1; }
#feature-list button { display: block; width: 100%; text-align: left; border: 0; background: none; padding: 3px 8px;
  font-family: monospace; cursor: pointer; white-space: pre; }
#feature-list button.on { background: #ffe0b0; }
#feature-detail { padding: 8px 16px; overflow-y: auto; flex: 1; }
.ctx { font-family: monospace; margin: 3px 0; white-space: pre; }
.ctx-act { display: inline-block; width: 5em; color: #666; }
.tok { border-radius: 2px; }
.tok-at { outline: 1px solid #c05000; }
.logit-box { display: flex; gap: 24px; }
table.logits td.num { text-align: right; padding-left: 12px; font-family: monospace; }
table.logits td.tok { font-family: monospace; }
"""


def page(report: dict) -> str:
    """The page's HTML: the report as JSON and features.js, inline."""
    data = json.dumps(report).replace("</", "<\\/")  # no '</script>' inside the JSON
    js = (STATIC / "features.js").read_text(encoding="utf-8")
    title = html.escape(f"SAE features: {report.get('site', '')}")
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title><style>{_CSS}</style></head>\n"
            f"<body><div id=\"feature-header\"></div><main><div id=\"side\">"
            f"<input id=\"feature-filter\" placeholder=\"feature id\"><div id=\"feature-list\"></div></div>"
            f"<div id=\"feature-detail\"></div></main>\n"
            f"<script id=\"feature-data\" type=\"application/json\">{data}</script>\n<script>{js}</script></body></html>\n")


def write_page(path: str | Path, report: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page(report), encoding="utf-8")
    tmp.replace(path)
    return path
