// glassformer explorer: patching sweeps as a heatmap and direct logit attribution as bars
// (docs/research.md). Every cell and bar is a button.num whose click shows, in the calculation
// panel (#explain), the clean, corrupt and patched numbers and how the metric was computed.
//
// Two homes: the live explorer (`glassformer view`), where the section asks POST api/patch and
// api/attribute and draws the answers; and the page `patch --html` / `attribute --html` writes,
// which holds its answer in <script id="research-data"> and has no server. As in glass.js, every
// text from the data reaches the page through textContent, never innerHTML.
'use strict';
(function () {
  const G = window.Glass || null;
  const byId = (id) => document.getElementById(id);

  function el(tag, props, children) {
    if (G) return G.el(tag, props, children);
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'text') e.textContent = String(v);
      else if (k === 'style') Object.assign(e.style, v);
      else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, String(v));
    }
    for (const c of [].concat(children === undefined || children === null ? [] : children)) {
      if (c === null || c === undefined || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }
  function fmt(x) {
    if (G) return G.fmt(x);
    if (typeof x !== 'number') return String(x);
    const a = Math.abs(x);
    if (a !== 0 && (a < 5e-4 || a >= 1e6)) return x.toExponential(2);
    return x.toFixed(4).replace(/\.?0+$/, '') || '0';
  }
  // A calculation as glass.js's panel reads it ({title, text, steps: [{label, formula, value}]}):
  // shown by Glass.showCalc in the explorer, by the few lines below in a saved page.
  function showCalc(calc) {
    if (G) { G.showCalc(calc, true); return; }
    const body = byId('explain-body');
    while (body.firstChild) body.removeChild(body.firstChild);
    body.append(el('div', { class: 'calc-title', text: calc.title }));
    if (calc.text) body.append(el('pre', { class: 'calc-text', text: calc.text }));
    calc.steps.forEach((st, k) => {
      const box = el('div', { class: 'calc-step' });
      box.append(el('div', { class: 'calc-step-head', text: `step ${k + 1}: ${st.label}` }));
      if (st.formula) box.append(el('div', { class: 'muted', text: st.formula }));
      box.append(el('div', {}, ['= ', el('b', { text: fmt(st.value) })]));
      body.append(box);
    });
  }
  function numButton(value, calc, extra) {
    const b = el('button', { class: 'num', type: 'button', text: fmt(value), title: `${calc.title}: click for its calculation` });
    Object.assign(b.dataset, extra || {});
    b.addEventListener('click', (ev) => {
      ev.stopPropagation();
      document.querySelectorAll('.num.active').forEach((x) => x.classList.remove('active'));
      b.classList.add('active');
      showCalc(calc);
    });
    return b;
  }
  // Blue where patching the cell restores the clean metric (fraction 1), red where it moves the
  // metric the other way, white where it leaves the corrupted run's.
  function shade(f) {
    if (!isFinite(f)) return '#ffffff';
    const t = Math.max(-1, Math.min(1, f));
    const c = Math.round(255 * (1 - Math.abs(t)));
    return t >= 0 ? `rgb(${c}, ${c}, 255)` : `rgb(255, ${c}, ${c})`;
  }

  // ------------------------------------------------------------------ the patching grid
  function cellCalc(r, layer, j) {
    const col = r.axes[1] === 'head' ? `head ${j}` : `position ${j} (${JSON.stringify(r.clean_tokens[j])})`;
    const where = `${r.probes[layer]}${r.axes[1] === 'head' ? `[:, h${j}]` : `[${j}]`}`;
    const a = r.answer.token, w = r.wrong.token, span = r.clean - r.corrupt;
    const steps = [
      { label: 'the clean run', formula: `logit(${JSON.stringify(a)}) − logit(${JSON.stringify(w)}) = ${fmt(r.clean_logits[0])} − ${fmt(r.clean_logits[1])}`, value: r.clean },
      { label: 'the corrupted run', formula: `${fmt(r.corrupt_logits[0])} − ${fmt(r.corrupt_logits[1])}`, value: r.corrupt }];
    let value;
    if (r.patched_answer) {
      value = r.patched_answer[layer][j] - r.patched_wrong[layer][j];
      steps.push({ label: `the corrupted run with ${where} taken from the clean run`,
        formula: `${fmt(r.patched_answer[layer][j])} − ${fmt(r.patched_wrong[layer][j])}`, value });
    }
    if (r.attribution) {
      steps.push({ label: 'attribution patching: the metric’s gradient in the corrupted run · (clean − corrupt) at the cell, summed over its features',
        formula: `corrupt + grad·Δ = ${fmt(r.corrupt)} + ${fmt(r.attribution_terms[layer][j])}`, value: r.attribution[layer][j] });
      if (value === undefined) value = r.attribution[layer][j];
    }
    steps.push({ label: 'the share of the clean − corrupt gap restored', formula: `(${fmt(value)} − ${fmt(r.corrupt)}) / (${fmt(r.clean)} − ${fmt(r.corrupt)})`,
      value: span === 0 ? NaN : (value - r.corrupt) / span });
    return { title: `${r.site} · layer ${layer} · ${col}: patched metric = ${fmt(value)}`,
      text: `metric: ${r.metric}\n(TransformerLens: patching.${r.transformer_lens})`, steps };
  }
  function drawGrid(box, r) {
    while (box.firstChild) box.removeChild(box.firstChild);
    const span = r.clean - r.corrupt;
    box.append(el('p', { class: 'note', text: `${r.site}, method ${r.method}: clean ${fmt(r.clean)}, corrupt ${fmt(r.corrupt)}` +
      (r.correlation !== undefined && r.correlation !== null ? `; attribution vs exact: Pearson r = ${fmt(r.correlation)}` : '') +
      '. Shade: the share of the gap a patch restores (blue 1, white 0, red −1).' }));
    const table = el('table', { class: 'grid research-grid' });
    const head = el('tr', {}, [el('th', { text: 'layer' })]);
    const cols = r.grid[0].length;
    for (let j = 0; j < cols; j++) head.append(el('th', { class: 'muted', text: r.axes[1] === 'head' ? `h${j}` : `${j} ${r.clean_tokens[j]}` }));
    table.append(head);
    r.grid.forEach((row, layer) => {
      const tr = el('tr', {}, [el('td', { class: 'probe', text: String(layer) })]);
      row.forEach((v, j) => {
        const b = numButton(v, cellCalc(r, layer, j), { layer: String(layer), col: String(j) });
        b.style.background = shade(span === 0 ? NaN : (v - r.corrupt) / span);
        tr.append(el('td', {}, b));
      });
      table.append(tr);
    });
    box.append(el('div', { class: 'scroll' }, table));
  }

  // ------------------------------------------------------------------ direct logit attribution
  function partCalc(d, name) {
    const det = d.details[name], v = d.parts[name];
    const dir = `(W_U[${JSON.stringify(d.answer.token)}] − W_U[${JSON.stringify(d.wrong.token)}])`;
    const steps = name === 'final_norm.bias'
      ? [{ label: 'the norm’s bias β reaches the head unscaled', formula: `β · ${dir}`, value: v }]
      : [{ label: `what ${name} writes into the stream at position ${d.position}: a vector c`, formula: '‖c‖', value: det.norm },
        { label: `c read by the head through the final norm’s gain γ${d.norm === 'layer' ? ' (c centred first)' : ''}`, formula: `c · (γ ⊙ ${dir})`, value: det.dot },
        { label: 'divided by the final norm’s scale, frozen at the run’s value', formula: `${fmt(det.dot)} / ${fmt(d.scale)}`, value: v }];
    steps.push({ label: 'all parts together: the model’s own logit difference', formula: `Σ parts = ${fmt(d.sum)}`, value: d.logit_diff });
    return { title: `${name}: ${fmt(v)} of logit(${JSON.stringify(d.answer.token)}) − logit(${JSON.stringify(d.wrong.token)})`,
      text: `${det.what}\n${d.note || ''}`.trim(), steps };
  }
  function drawBars(box, d) {
    while (box.firstChild) box.removeChild(box.firstChild);
    const names = Object.keys(d.parts);
    const most = Math.max(1e-12, ...names.map((n) => Math.abs(d.parts[n])));
    box.append(el('p', { class: 'note', text: `logit(${JSON.stringify(d.answer.token)}) − logit(${JSON.stringify(d.wrong.token)}) at position ${d.position}: ` +
      `${fmt(d.logit_diff)}; the parts sum to ${fmt(d.sum)} (final norm scale frozen at ${fmt(d.scale)}).` + (d.note ? ' ' + d.note : '') }));
    const table = el('table', { class: 'grid research-bars' });
    for (const n of names) {
      const v = d.parts[n], w = Math.round(120 * Math.abs(v) / most);
      const bar = el('span', { style: { display: 'inline-block', height: '10px', width: `${w}px`, background: v >= 0 ? '#4a6cf7' : '#e0524c',
        marginLeft: v >= 0 ? '120px' : `${120 - w}px` } });
      table.append(el('tr', {}, [el('td', { class: 'probe', text: n }), el('td', {}, bar), el('td', {}, numButton(v, partCalc(d, n), { part: n }))]));
    }
    box.append(table);
  }

  // ------------------------------------------------------------------ a saved page
  const saved = byId('research-data');
  if (saved) {
    const data = JSON.parse(saved.textContent);
    const sec = byId('view-research');
    if (data.patch) { const box = el('div', { id: 'research-grid' }); sec.append(el('h3', { text: 'Activation patching' }), box); drawGrid(box, data.patch); }
    if (data.attribute) { const box = el('div', { id: 'research-bars' }); sec.append(el('h3', { text: 'Direct logit attribution' }), box); drawBars(box, data.attribute); }
    return;
  }
  if (!G) return;

  // ------------------------------------------------------------------ the live explorer
  function post(route, body, box) {
    box.classList.add('stale');
    return fetch(route, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) })
      .then(async (res) => {
        const answer = await res.json();
        box.classList.remove('stale');
        if (!res.ok) { G.message(G.errorText(answer, res.status)); return null; }
        return answer;
      }).catch((e) => { box.classList.remove('stale'); G.message(`could not reach the server: ${e}`); return null; });
  }
  function frame() {
    const sec = byId('view-research');
    if (!sec || sec.dataset.built) return sec;
    sec.dataset.built = '1';
    sec.hidden = false;
    const input = (id, label, size) => el('label', {}, [label + ' ', el('input', { id, type: 'text', size: String(size || 8), spellcheck: 'false' })]);
    const site = el('select', { id: 'research-site' }, ['resid_pre', 'attn_out', 'mlp_out', 'z'].map((s) => el('option', { value: s, text: s })));
    const method = el('select', { id: 'research-method' }, ['exact', 'attribution', 'both'].map((s) => el('option', { value: s, text: s })));
    sec.append(
      el('h2', { text: 'Patching and direct logit attribution' }),
      el('p', { class: 'lede', text: 'Activation patching: the corrupted text is run with one activation (a layer at one position, or one head\u2019s z) taken from the clean text\u2019s run; each cell is the metric logit(answer) \u2212 logit(wrong) at the last position of that patched run. Direct logit attribution splits the sentence\u2019s own logit difference into what the embedding, each head and each MLP write, read through the final norm with its scale frozen. Click a cell or a bar for its numbers.' }),
      el('div', { class: 'controls' }, [input('research-clean', 'clean', 24), input('research-corrupt', 'corrupt', 24),
        input('research-answer', 'answer'), input('research-wrong', 'wrong'),
        el('label', {}, ['site ', site]), el('label', {}, ['method ', method]),
        el('button', { id: 'research-patch', type: 'button', text: 'patch' }),
        el('button', { id: 'research-attribute', type: 'button', text: 'attribute the clean text' })]),
      el('div', { id: 'research-grid' }), el('div', { id: 'research-bars' }));
    const value = (id) => byId(id).value;
    byId('research-patch').addEventListener('click', () => {
      const box = byId('research-grid');
      post('api/patch', { clean: value('research-clean'), corrupt: value('research-corrupt'), answer: value('research-answer'),
        wrong: value('research-wrong'), site: value('research-site'), method: value('research-method') }, box)
        .then((r) => { if (r) drawGrid(box, r); });
    });
    byId('research-attribute').addEventListener('click', () => {
      const box = byId('research-bars');
      post('api/attribute', { text: value('research-clean'), answer: value('research-answer'), wrong: value('research-wrong') }, box)
        .then((d) => { if (d) drawBars(box, d); });
    });
    return sec;
  }
  G.view({
    draw() {
      if (G.P().mode !== 'server') return; // a saved explorer page has no server to patch with
      const sec = frame();
      if (!sec) return;
      const clean = byId('research-clean');
      if (!clean.value && G.P().sentence) clean.value = G.P().sentence; // the page's sentence, to start from
    },
  });
})();
