// glassformer explorer: the head switch (viewer/heads.py). A live page can show the same model as
// MHA, GQA or MQA without a restart: fewer key/value heads are made by averaging each group's W_K and
// W_V (as `glassformer convert --kv-heads` does), nothing retrained, and the page says so. The choice
// goes to POST api/heads and comes back as the page's checkpoint ("kv_heads=K"), so every later
// request of the page (explain, sample, generate) is answered by that model. Each averaged weight
// shown opens its mean. Safety: as in glass.js, data reaches the page through text nodes only.
'use strict';
(function () {
  const G = window.Glass;
  const { el, clear, fmt, $, P, calcNum, message, errorText } = G;

  function bar() {
    let box = $('heads-switch');
    if (box) return box;
    box = el('div', { id: 'heads-switch', class: 'heads-switch' });
    $('view-attention').querySelector('.controls').after(box);
    $('attn-layer').addEventListener('change', () => draw());
    return box;
  }
  function label(h, k) {
    const own = k === h.base_kv_heads;
    return `${k} KV ${k === 1 ? 'head' : 'heads'}: ${h.kinds[String(k)]}${own ? ' (the model’s own)' : ' (averaged)'}`;
  }
  async function choose(value) {
    const select = $('kv-heads');
    select.disabled = true;
    $('busy').hidden = false;
    try {
      const res = await fetch('api/heads', { method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ text: P().sentence, kv_heads: value === '' ? null : Number(value) }) });
      const body = await res.json();
      if (!res.ok) { message(errorText(body, res.status)); return; }
      message('');
      G.setPayload(body); // every view redraws with the chosen model; this one from body.heads
    } catch (e) {
      message(`could not reach the server: ${e}`);
    } finally { $('busy').hidden = true; if ($('kv-heads')) $('kv-heads').disabled = false; }
  }
  function weightsTable(h) {
    const layer = G.state.layer, rows = (h.weights || []).filter((w) => w.layer === layer);
    if (!rows.length) return null;
    const table = el('table', { class: 'grid heads-weights' });
    table.append(el('tr', {}, ['averaged weight', 'KV head', 'value (click: the mean)'].map((t) => el('th', { text: t }))));
    for (const w of rows) {
      const name = `W_${w.matrix.toUpperCase()}'[${w.row}, ${w.head * G.CFG().head_dim}]`;
      table.append(el('tr', {}, [el('td', { class: 'probe', text: `L${w.layer} ${name}` }), el('td', { text: String(w.head) }),
        el('td', {}, calcNum(fmt(w.value), w.calc, { layer: String(w.layer), matrix: w.matrix, head: String(w.head), row: String(w.row) }))]));
    }
    return table;
  }
  function draw() {
    const h = P().heads, live = P().mode === 'server';
    const box = $('heads-switch');
    if (!h || !live) { if (box) { clear(box); box.hidden = true; } return; }
    const b = bar();
    clear(b);
    b.hidden = false;
    const select = el('select', { id: 'kv-heads', 'aria-label': 'key/value heads' });
    if (h.opened) select.append(el('option', { value: '', text: h.opened }));
    for (const k of h.options) select.append(el('option', { value: String(k), text: label(h, k) }));
    select.value = h.kv_heads === null || h.kv_heads === undefined ? '' : String(h.kv_heads);
    select.disabled = h.options.length < 2 && !h.opened;
    select.addEventListener('change', () => choose(select.value));
    b.append(el('div', { class: 'controls' }, [el('label', {}, ['MHA / GQA / MQA: ', select]),
      el('span', { class: 'muted', text: `${h.n_heads} query ${h.n_heads === 1 ? 'head' : 'heads'}; fewer KV heads are made by averaging, not by training` })]));
    if (h.pooled) {
      const note = el('p', { id: 'heads-averaged', class: 'note heads-averaged', text: h.about });
      b.append(note);
      const t = weightsTable(h);
      if (t) b.append(el('details', {}, [el('summary', { text: `the averaged W_K and W_V of layer ${G.state.layer}: a few entries` }), t]));
    }
  }
  G.view({ draw });
})();
