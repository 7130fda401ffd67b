// The SAE feature browser (glassformer sae features --html; docs/research.md#sparse-autoencoders).
// Reads the report `sae features --json` prints from <script id="feature-data">, then draws the list of
// features and, for the one picked, its top-activating contexts (each token shaded by the feature's
// activation on it, the activating one outlined) and its decoder row's effect on the logits.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("feature-data").textContent);
  const list = document.getElementById("feature-list");
  const detail = document.getElementById("feature-detail");
  const filter = document.getElementById("feature-filter");

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // Whitespace and newlines drawn so a token's extent shows.
  function shown(piece) {
    return piece.replace(/\n/g, "\u23CE").replace(/ /g, "\u00B7");
  }

  function header() {
    const h = document.getElementById("feature-header");
    const ev = data.evaluation;
    h.textContent = `${data.sae}: ${data.d_sae} features (k ${data.k}) on ${data.site} (probe ${data.probe}, width ` +
      `${data.d_in}); ${data.tokens} tokens read, ${data.dead_features} features never fired` +
      (ev ? `; explained variance ${ev.explained_variance.toFixed(4)}, L0 ${ev.l0.toFixed(2)}` : "");
  }

  function context(c, max) {
    const row = el("div", { class: "ctx" });
    row.appendChild(el("span", { class: "ctx-act" }, c.act.toFixed(3)));
    c.tokens.forEach((t, j) => {
      const a = c.acts[j];
      const s = el("span", { class: "tok" + (j === c.at ? " tok-at" : ""), title: `activation ${a}` }, shown(t));
      if (a > 0) s.style.background = `rgba(255, 140, 0, ${Math.min(1, a / (max || 1)).toFixed(3)})`;
      row.appendChild(s);
    });
    return row;
  }

  function logitTable(title, rows) {
    const t = el("table", { class: "logits" });
    const head = el("tr");
    head.appendChild(el("th", { colspan: "2" }, title));
    t.appendChild(head);
    for (const [tok, v] of rows) {
      const r = el("tr");
      r.appendChild(el("td", { class: "tok" }, shown(tok)));
      r.appendChild(el("td", { class: "num" }, v.toFixed(4)));
      t.appendChild(r);
    }
    return t;
  }

  function show(f) {
    detail.replaceChildren();
    detail.appendChild(el("h2", {}, `feature ${f.id}`));
    detail.appendChild(el("p", {}, `fires on ${(100 * f.frequency).toFixed(2)}% of tokens; largest activation ` +
      `${f.max}. Shading: the feature's activation on each token over its largest.`));
    detail.appendChild(el("h3", {}, "top-activating contexts"));
    if (!f.contexts.length) detail.appendChild(el("p", {}, "it never fired on the tokens read"));
    for (const c of f.contexts) detail.appendChild(context(c, f.max));
    if (f.logits) {
      detail.appendChild(el("h3", {}, "effect on the logits (its decoder row through the final norm and the head)"));
      const box = el("div", { class: "logit-box" });
      box.appendChild(logitTable("promotes", f.logits.top));
      box.appendChild(logitTable("suppresses", f.logits.bottom));
      detail.appendChild(box);
    }
    for (const b of list.querySelectorAll("button")) b.classList.toggle("on", Number(b.dataset.id) === f.id);
  }

  function drawList() {
    list.replaceChildren();
    const want = filter.value.trim();
    for (const f of data.features) {
      if (want && !String(f.id).startsWith(want)) continue;
      const b = el("button", { "data-id": String(f.id) }, `${f.id}  ${(100 * f.frequency).toFixed(1)}%  max ${f.max}`);
      b.addEventListener("click", () => show(f));
      list.appendChild(b);
    }
  }

  header();
  filter.addEventListener("input", drawList);
  drawList();
  if (data.features.length) show(data.features[0]);
})();
