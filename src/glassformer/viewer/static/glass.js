// glassformer explorer: draws one trace (design.md "Trace files") in plain DOM and SVG.
//
// Safety rule for this file: every text that comes from the data (tokens, the sentence,
// pieces, explain text, error messages) reaches the page through textContent or a text
// node, never through innerHTML, so a sentence that is itself HTML (an img tag with an
// onerror handler, say) is shown as text and runs nothing.
'use strict';
(function () {
  const SVGNS = 'http://www.w3.org/2000/svg';
  const FEATURE_CAP = 8; // features shown per vector (per head); the rest are summarised

  // ------------------------------------------------------------------ small helpers
  function el(tag, props, children) {
    const e = document.createElement(tag);
    setProps(e, props);
    append(e, children);
    return e;
  }
  function svg(tag, props, children) {
    const e = document.createElementNS(SVGNS, tag);
    setProps(e, props);
    append(e, children);
    return e;
  }
  function setProps(e, props) {
    if (!props) return;
    for (const [k, v] of Object.entries(props)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'text') e.textContent = String(v);
      else if (k === 'class') e.setAttribute('class', v);
      else if (k === 'style') Object.assign(e.style, v);
      else if (k === 'dataset') Object.assign(e.dataset, v);
      else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, String(v));
    }
  }
  function append(e, children) {
    if (children === null || children === undefined) return;
    for (const c of [].concat(children)) {
      if (c === null || c === undefined || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
  }
  function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); return e; }
  const $ = (id) => document.getElementById(id);

  function fmt(x) {
    if (x === null || x === undefined) return '';
    if (typeof x !== 'number') return String(x);
    if (!isFinite(x)) return x > 0 ? '∞' : (x < 0 ? '-∞' : 'NaN');
    const a = Math.abs(x);
    let s;
    if (a !== 0 && (a < 5e-4 || a >= 1e6)) s = x.toExponential(2).replace(/\.?0+e/, 'e');
    // Below 0.1, three significant digits (0.00123, 0.0456): three decimals would round them to 0.001.
    else if (a !== 0 && a < 0.1) s = x.toPrecision(3).replace(/\.?0+$/, '');
    else s = x.toFixed(3).replace(/\.?0+$/, '');
    return s === '-0' ? '0' : s;
  }
  function fmtP(x) { return typeof x === 'number' && x < 0 ? `(${fmt(x)})` : fmt(x); } // a factor in a product
  function fmtInt(n) { return Number(n).toLocaleString('en-US'); }
  function fmtBytes(b) {
    const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
    let i = 0, x = Number(b);
    while (Math.abs(x) >= 1024 && i < u.length - 1) { x /= 1024; i++; }
    return (i === 0 ? String(x) : x.toFixed(x < 10 ? 2 : 1)) + ' ' + u[i];
  }
  function fmtBig(n) {
    const x = Number(n), a = Math.abs(x);
    const units = [[1e15, 'P'], [1e12, 'T'], [1e9, 'G'], [1e6, 'M'], [1e3, 'k']];
    for (const [v, s] of units) if (a >= v) return (x / v).toFixed(a / v < 10 ? 2 : 1) + ' ' + s;
    return fmt(x);
  }
  function tokColor(i, alpha) {
    const hue = (i * 137.508 + 210) % 360;
    return alpha === undefined ? `hsl(${hue.toFixed(0)}, 62%, 44%)` : `hsla(${hue.toFixed(0)}, 62%, 44%, ${alpha})`;
  }
  // RMS of token t's vector in a probe, as Python measured it (tracing.stream.stream_rms).
  function rmsOf(name, t) { return P().rms[name][t]; }
  function range(n) { return Array.from({ length: n }, (_, i) => i); }

  // ------------------------------------------------------------------ state
  const state = {
    payload: JSON.parse($('glass-data').textContent),
    token: 0, layer: 0, flashLayer: 0, flashHead: 0, flashTile: 2, flashStep: 0,
    decLayer: 0, decHead: 0, history: [], current: null,
  };
  const P = () => state.payload;
  const TR = () => state.payload.trace;
  const CFG = () => state.payload.trace.config || {};
  const T = () => TR().tokens.length;
  function probe(name) { const p = TR().probes[name]; return p ? p.data : null; }
  function hasProbe(name) { return Object.prototype.hasOwnProperty.call(TR().probes, name); }
  function axesOf(name) { const p = TR().probes[name]; return p ? (p.axes || []) : []; }
  function nLayers() { return CFG().n_layers || 0; }
  // A trace may keep some layers and heads only (--layers, --heads): `layers` lists the
  // traced blocks, and a probe's `index[axis]` the model's ids of its stored entries.
  function layerIds() { return TR().layers || range(nLayers()); }
  function axisIds(name, axis, n) {
    const p = TR().probes[name], ix = p && p.index && p.index[axis];
    return ix && !Array.isArray(ix[0]) ? ix : range(n);
  }
  function headIds(layer) { return axisIds(`blocks.${layer}.attn.weights`, 'head', CFG().n_heads); }
  function kvPos(layer, name, head) {
    // Stored position, in a key/value probe, of the KV head that query head `head` reads.
    const kv = Math.floor(head / (CFG().n_heads / CFG().n_kv_heads));
    return axisIds(name, 'kv_head', CFG().n_kv_heads).indexOf(kv);
  }
  // Every token is drawn as the server's label of it (text.labels.token_label: ␣ for a space,
  // ↵ for a newline); the raw tokens stay in the trace.
  function tokenLabel(i) { const t = (P().labels || TR().tokens)[i]; return t === undefined ? `#${i}` : String(t); }
  function postNorm() { return CFG().norm_placement === 'post'; }
  // The probe that holds the residual stream after each addition of block i ('mid' after
  // attention, 'out' leaving the block) comes with the data (probes.STREAM_WIRING).
  function streamAfter(i, part) { return P().wiring[i][part]; }

  // A clickable number: its probe name and index travel with it so a click can ask for
  // its calculation (precomputed in the file, or from the server's /api/explain).
  function num(value, probeName, index, extra) {
    const b = el('button', { class: 'num', type: 'button', text: fmt(value), title: `${probeName}${idxLabel(probeName, index)} = ${value}` });
    b.dataset.probe = probeName;
    b.dataset.index = JSON.stringify(index);
    b.addEventListener('click', (ev) => {
      ev.stopPropagation();
      if (extra && extra.local) showCalc(extra.local(), true);
      else explain(probeName, index, true);
    });
    return b;
  }
  // A number whose calculation the page already holds (an RMS of the comparison, a cost):
  // a click shows it; its operands link on as any calculation's do.
  function calcNum(text, calc, data) {
    const b = el('button', { class: 'num', type: 'button', text, title: calc ? (calc.title || '') + ': click for its calculation' : '' });
    Object.assign(b.dataset, data || {});
    if (!calc) { b.disabled = true; return b; }
    b.addEventListener('click', (ev) => {
      ev.stopPropagation();
      document.querySelectorAll('.num.active').forEach((x) => x.classList.remove('active'));
      b.classList.add('active');
      showCalc(calc, true);
    });
    return b;
  }
  function idxLabel(probeName, index) {
    const axes = axesOf(probeName);
    const parts = index.map((v, d) => {
      const ax = axes[d];
      if (ax === 'token' || (d === 0 && !ax && hasProbe(probeName))) return tokenLabel(v);
      if (ax === 'head') return `h${v}`;
      if (ax === 'kv_head') return `kv${v}`;
      if (ax === 'vocab') return pieceOf(v);
      if (ax === 'key') return `→${tokenLabel(v)}`;
      return String(v);
    });
    return `[${parts.join(', ')}]`;
  }
  function pieceOf(id) {
    for (const row of P().next || []) for (const c of row) if (c.id === id) return `“${c.label}”`;
    return `#${id}`;
  }
  function vector(values, probeName, prefix, opts) {
    const box = el('span', { class: 'vec' });
    const cap = (opts && opts.cap) || FEATURE_CAP;
    const n = Math.min(values.length, cap);
    // A slimmed probe keeps only the first features; its shape still tells the full width.
    const p = TR().probes[probeName], full = p && p.cut ? p.shape[p.shape.length - 1] : values.length;
    for (let f = 0; f < n; f++) box.append(num(values[f], probeName, prefix.concat([f])));
    if (full > n) box.append(el('span', { class: 'more', text: `… +${full - n} more` }));
    return box;
  }
  function fillSelect(sel, ids, label, value, onChange) {
    // ids: the values to offer (a count n means 0..n-1); returns the value selected.
    if (typeof ids === 'number') ids = range(ids);
    clear(sel);
    for (const i of ids) sel.append(el('option', { value: String(i), text: label(i) }));
    const v = ids.includes(value) ? value : ids[0];
    sel.value = String(v);
    sel.onchange = () => onChange(Number(sel.value));
    return v;
  }
  function message(text) {
    const m = $('message');
    if (!text) { m.hidden = true; m.textContent = ''; return; }
    m.hidden = false; m.textContent = text;
  }
  // A live page's data comes in two goes: the server's answer holds what the page draws first,
  // and a part it shows later (another row's walks, another token's RMS calculations) is asked
  // for once, through api/explain with the part's name (viewer/source.py LiveParts); `merge`
  // puts the answer into the data it was asked for, and `redraw` draws it if still shown.
  // An error answer's text: the explorer's own {"error": message}, or the OpenAI-shaped
  // {"error": {"message"}} that serve --explorer's shared guards (403, 404, 413) answer with.
  function errorText(body, status) {
    const e = body && body.error;
    return (typeof e === 'string' ? e : e && e.message) || `the server answered ${status}`;
  }

  // True while the part is on its way; false where there is none to ask for (or it came).
  function askPart(name, index, merge, redraw) {
    const p = P(), key = `${name}|${index.join(',')}`;
    if (p.mode !== 'server' || !name) return false;
    p.asked = p.asked || {};
    if (p.asked[key] === 'done') return false;
    if (p.asked[key] === 'pending') return true;
    p.asked[key] = 'pending';
    fetch('api/explain', { method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ text: p.sentence, probe: name, index, checkpoint: p.checkpoint }) })
      .then(async (res) => {
        const body = await res.json();
        if (res.ok) merge(p, body);
        else message(errorText(body, res.status));
      })
      .catch((e) => message(`could not reach the server: ${e}`))
      .finally(() => { p.asked[key] = 'done'; if (P() === p) redraw(); });
    return true;
  }

  // ------------------------------------------------------------------ header and tokens
  function drawHeader() {
    const c = CFG(), p = P();
    const s = clear($('model-summary'));
    const parts = [
      ['model', p.model_name || 'model'], ['layers', c.n_layers], ['width D', c.dim], ['heads', `${c.n_heads} query / ${c.n_kv_heads} KV`],
      ['head size', c.head_dim], ['FFN', `${c.ffn} ${c.ffn_dim}`], ['norm', `${c.norm_placement}-${c.norm}`], ['vocab', c.vocab_size],
    ];
    parts.forEach(([k, v], i) => { if (i) s.append(' · '); s.append(`${k} `, el('b', { text: v })); });
    const input = $('sentence');
    if (document.activeElement !== input) input.value = p.sentence || TR().tokens.join(' ');
    const live = p.mode === 'server';
    input.disabled = !live; $('run').disabled = !live;
    const hint = clear($('vocab-hint'));
    if (p.vocab) hint.append('Words this model knows: ', el('b', { text: p.vocab.join(' · ') }), '. ');
    if (!live) hint.append('This is a saved page: run `glassformer view` to trace a sentence of your own.');
    $('foot').textContent = (p.notes || []).join(' ');
    document.title = `glassformer · ${p.sentence || TR().tokens.join(' ')}`;
  }
  function drawTokens() {
    const nav = clear($('tokens'));
    TR().tokens.forEach((_, i) => {
      const b = el('button', { class: 'tok' + (i === state.token ? ' sel' : ''), type: 'button', style: { background: tokColor(i) } },
        [el('span', { class: 'pos', text: String(TR().positions ? TR().positions[i] : i) }), tokenLabel(i)]);
      b.dataset.token = String(i);
      b.addEventListener('click', () => {
        state.token = i; drawTokens(); drawLanes(); drawNumbers(); drawNorm(); drawFlash(); drawSample();
        eachView('onToken');
      });
      nav.append(b);
    });
  }

  // ------------------------------------------------------------------ 1 lanes
  function streamSteps() {
    const steps = [{ label: 'embed', probe: 'embed', kind: 'stream' }];
    for (const i of layerIds()) {
      steps.push({ label: `L${i} attention`, probe: streamAfter(i, 'attn_adds') || `blocks.${i}.attn.out`, kind: 'attn', layer: i });
      const oneAddition = streamAfter(i, 'out') === streamAfter(i, 'mid');  // ffn none: the block ends here
      steps.push({ label: `L${i} +`, probe: streamAfter(i, 'mid'), kind: 'stream', layer: i, part: oneAddition ? 'out' : 'mid' });
      steps.push({ label: `L${i} feed-forward`, probe: streamAfter(i, 'ffn_adds') || `blocks.${i}.ffn.down`, kind: 'ffn', layer: i });
      if (!oneAddition) {
        steps.push({ label: `L${i} +`, probe: streamAfter(i, 'out'), kind: 'stream', layer: i, part: 'out' });
      }
    }
    steps.push({ label: 'final norm', probe: 'final_norm', kind: 'norm' });
    return steps.filter((s) => hasProbe(s.probe));
  }
  function rmsCalc(probeName, t) {
    const v = probe(probeName)[t];
    const r = rmsOf(probeName, t);
    const terms = v.slice(0, FEATURE_CAP).map((x) => `${fmtP(x)}²`).join(' + ')  // (−0.349)², not −0.349² + (v.length > FEATURE_CAP ? ` + … (${v.length - FEATURE_CAP} more)` : '');
    return {
      title: `RMS of ${probeName}[${tokenLabel(t)}] = ${fmt(r)}`, op: 'rms',
      text: `RMS = √( (${terms}) / ${v.length} ) = √${fmt(r * r)} = ${fmt(r)}`,
      operands: v.slice(0, FEATURE_CAP).map((x, f) => ({ probe: probeName, index: [t, f], value: x })),
    };
  }
  function drawLanes() {
    const box = clear($('lanes'));
    const steps = streamSteps();
    if (!steps.length) { box.append(el('p', { class: 'muted', text: 'The trace holds no residual-stream probes.' })); return; }
    // With many tokens the lanes pack closer and the branch RMS moves into the branch's
    // tooltip, so that no two numbers overlap; the drawing scrolls sideways when wide.
    const nT = T(), many = nT > 12, laneH = many ? 32 : 44, left = 110, top = 34;
    const avail = Math.max(600, box.clientWidth || 900);
    const colW = Math.max(86, Math.min(150, Math.floor((avail - left - 60) / Math.max(1, steps.length - 1))));
    const W = left + colW * (steps.length - 1) + 70, H = top + laneH * nT + 10;
    const all = [];
    const R = steps.map((s) => probe(s.probe).map((v, t) => { const r = rmsOf(s.probe, t); all.push(r); return r; }));
    const maxR = Math.max(...all, 1e-9);
    const root = svg('svg', { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'lanes' });
    steps.forEach((s, c) => {
      const x = left + c * colW;
      root.append(svg('text', { x, y: 14, 'text-anchor': 'middle', class: 'col-label', text: s.kind === 'stream' && s.label.endsWith('+') ? '+' : s.label }));
      if (s.part === 'out') {  // the end of a block
        root.append(svg('line', { x1: x + colW / 2, y1: 20, x2: x + colW / 2, y2: H - 4, stroke: '#eef0f3', 'stroke-dasharray': '3 3' }));
      }
    });
    for (let t = 0; t < nT; t++) {
      const y = top + t * laneH + laneH / 2;
      const g = svg('g', { class: 'lane' + (t === state.token ? ' sel' : '') });
      g.dataset.token = String(t);
      const col = tokColor(t);
      const full = tokenLabel(t), short = full.length > 11 ? full.slice(0, 10) + '…' : full;
      g.append(svg('title', { text: full }));
      g.append(svg('text', { x: left - 24, y: y + 4, 'text-anchor': 'end', class: 'lane-label', fill: col, text: short }));
      // The stream itself: a line from join to join; branches leave it and come back at the +.
      let prevX = left, prevR = R[0][t];
      steps.forEach((s, c) => {
        const x = left + c * colW, r = R[c][t];
        const w = 1.5 + 6 * r / maxR;
        if (s.kind === 'attn' || s.kind === 'ffn') {
          const bx = x, by = y - laneH * 0.36, jx = x + colW;
          g.append(svg('path', { d: `M ${prevX} ${y} C ${prevX + 30} ${y}, ${bx - 30} ${by}, ${bx - 8} ${by}`, fill: 'none', stroke: col, 'stroke-opacity': 0.55, 'stroke-width': 1.4 }));
          g.append(svg('path', { d: `M ${bx + 8} ${by} C ${bx + 30} ${by}, ${jx - 30} ${y}, ${jx - 6} ${y}`, fill: 'none', stroke: col, 'stroke-opacity': 0.55, 'stroke-width': 1.2 + 4 * r / maxR }));
          g.append(svg('rect', { x: bx - 8, y: by - 5, width: 16, height: 10, rx: 3, fill: '#fff', stroke: col, 'stroke-width': 1.2 },
            svg('title', { text: `${s.label} adds RMS ${fmt(r)} to “${tokenLabel(t)}”` })));
          g.append(svg('text', { x: bx, y: by + 3, 'text-anchor': 'middle', class: 'branch-label', text: s.kind === 'attn' ? 'A' : 'F' }));
          if (!many) {
            const lab = svg('text', { x: bx, y: by - 8, 'text-anchor': 'middle', class: 'rms', text: fmt(r) });
            lab.addEventListener('click', () => showCalc(rmsCalc(s.probe, t), true));
            lab.dataset.probe = s.probe; lab.dataset.token = String(t);
            g.append(lab);
          }
          return;
        }
        if (c > 0) g.append(svg('line', { x1: prevX, y1: y, x2: x, y2: y, stroke: col, 'stroke-width': 1.5 + 6 * prevR / maxR, 'stroke-linecap': 'round' }));
        const isJoin = s.label.endsWith('+');
        g.append(svg('circle', { cx: x, cy: y, r: isJoin ? 7 : 5, fill: '#fff', stroke: col, 'stroke-width': 2 }));
        if (isJoin) g.append(svg('text', { x, y: y + 3.5, 'text-anchor': 'middle', class: 'branch-label', fill: col, text: '+' }));
        const lab = svg('text', { x: x + 10, y: y + (laneH > 36 ? 15 : 12), class: 'rms', text: fmt(r) });
        lab.addEventListener('click', () => showCalc(rmsCalc(s.probe, t), true));
        lab.dataset.probe = s.probe; lab.dataset.token = String(t);
        g.append(lab);
        prevX = x; prevR = r;
        void w;
      });
      root.append(g);
    }
    box.append(root);
    box.append(el('p', { class: 'note', text: `A = attention branch, F = feed-forward branch; ${many ? 'hover a branch for' : 'numbers over a branch are'} the RMS of what it adds. ${postNorm() ? 'Post-norm: the stream after each + is normalised, so its RMS stays near 1.' : 'Pre-norm: the stream is never normalised until the final norm, so its RMS grows.'}` }));
  }

  // ------------------------------------------------------------------ 2 attention
  function headSummary(W) {
    // Share of weight on the previous token, the first token and the token itself,
    // averaged over the queries that have a choice (position > 0).
    let prev = 0, first = 0, self = 0, n = 0;
    for (let i = 1; i < W.length; i++) {
      const row = W[i];
      prev += row[i - 1] || 0; first += row[0] || 0; self += row[i] || 0; n++;
    }
    return n ? { prev: prev / n, first: first / n, self: self / n } : null;
  }
  function drawAttention() {
    state.layer = fillSelect($('attn-layer'), layerIds(), (i) => `${i}`, state.layer, (v) => { state.layer = v; drawAttention(); drawNumbers(); });
    const box = clear($('heatmaps'));
    const wName = `blocks.${state.layer}.attn.weights`, sName = `blocks.${state.layer}.attn.scores`;
    const W = probe(wName), S = probe(sName);
    if (!W) { box.append(el('p', { class: 'muted', text: 'This trace holds no attention weights for this layer.' })); return; }
    const nT = W.length, nH = W[0].length, nK = W[0][0].length;
    const cell = Math.max(11, Math.min(46, Math.floor(300 / nK)));
    const heads = headIds(state.layer);
    const showText = cell >= 34;
    const tip = $('tooltip');
    for (let h = 0; h < nH; h++) {
      const head = heads[h];
      const card = el('div', { class: 'heatmap-card' });
      card.dataset.head = String(head);
      card.append(el('h3', { text: `layer ${state.layer} · head ${head}` + (CFG().n_kv_heads < CFG().n_heads ? ` (KV head ${Math.floor(head / (CFG().n_heads / CFG().n_kv_heads))})` : '') }));
      const grid = el('div', { class: 'heatmap', style: { gridTemplateColumns: `auto repeat(${nK}, ${cell}px)` } });
      grid.append(el('div'));
      for (let j = 0; j < nK; j++) grid.append(el('div', { class: 'hdr khdr', text: tokenLabel(j), title: tokenLabel(j) }));
      const Wh = [];
      for (let i = 0; i < nT; i++) {
        grid.append(el('div', { class: 'hdr qhdr', text: tokenLabel(i), title: tokenLabel(i), style: { lineHeight: `${cell}px` } }));
        const row = [];
        for (let j = 0; j < nK; j++) {
          const w = W[i][h][j];
          const s = S ? S[i][h][j] : null;
          row.push(w);
          const c = el('div', { class: 'cell' + (w === null ? ' masked' : ''), style: { height: `${cell}px` } });
          c.dataset.q = String(i); c.dataset.k = String(j);
          if (w !== null) {
            c.style.background = `rgba(47, 111, 214, ${0.06 + 0.94 * w})`;
            if (w > 0.55) c.style.color = '#fff';
            if (showText) c.textContent = fmt(w);
            c.addEventListener('click', () => explain(wName, [i, head, j], true));
          }
          c.addEventListener('mouseenter', (ev) => {
            tip.hidden = false;
            tip.textContent = `query ${tokenLabel(i)} (pos ${i})\nkey   ${tokenLabel(j)} (pos ${j})\nscore ${s === null ? '—' : fmt(s)}\nweight ${w === null ? 'masked (future token)' : fmt(w)}`;
            moveTip(ev);
          });
          c.addEventListener('mousemove', moveTip);
          c.addEventListener('mouseleave', () => { tip.hidden = true; });
          grid.append(c);
        }
        Wh.push(row);
      }
      card.append(grid);
      const sum = headSummary(Wh);
      if (sum) {
        const bars = el('div', { class: 'summary-bars' });
        const names = [['previous token', sum.prev], ['first token', sum.first], ['itself', sum.self]];
        let best = names.reduce((a, b) => (b[1] > a[1] ? b : a));
        for (const [k, v] of names) {
          bars.append(el('div', { class: 'bar-row' }, [el('span', { text: k }), el('div', { class: 'bar' }, el('span', { style: { width: `${(100 * v).toFixed(1)}%` } })), el('span', { text: `${(100 * v).toFixed(0)}%` })]));
        }
        if (best[1] > 0.5) card.querySelector('h3').append(el('span', { class: 'badge', text: best[0] === 'first token' ? 'first-token (sink) head' : best[0] === 'itself' ? 'self head' : 'previous-token head' }));
        card.append(bars);
      }
      box.append(card);
    }
    eachView('onAttention');  // a view may add to the maps drawn (families.js: each head's sink weight)
  }
  function moveTip(ev) {
    const tip = $('tooltip');
    tip.style.left = `${ev.clientX + 14}px`; tip.style.top = `${ev.clientY + 12}px`;
  }

  // ------------------------------------------------------------------ 3 numbers
  const BLOCK_PROBES = [
    ['attn_norm', 'normalised copy read by attention'], ['attn.q', 'queries'], ['attn.k', 'keys'], ['attn.v', 'values'],
    ['attn.q_rot', 'queries after RoPE'], ['attn.k_rot', 'keys after RoPE'], ['attn.z', 'weighted sum of values, per head'],
    ['attn.out', 'after the output projection W_O'], ['resid_mid', 'stream + attention'], ['ffn_norm', 'normalised copy read by the FFN'],
    ['ffn.up', 'up projection'], ['ffn.gate', 'gate projection'], ['ffn.act', 'after the activation'], ['ffn.down', 'down projection'],
    ['resid_out', 'stream + feed-forward'],
  ];
  function drawNumbers() {
    const L = nLayers();
    state.layer = fillSelect($('num-layer'), layerIds(), (i) => `${i}`, state.layer, (v) => { state.layer = v; drawNumbers(); drawAttention(); });
    $('num-token').textContent = `token ${state.token}: ${tokenLabel(state.token)}`;
    const box = clear($('numbers'));
    const table = el('table', { class: 'grid' });
    table.append(el('tr', {}, [el('th', { text: 'probe' }), el('th', { text: 'value' }), el('th', { text: 'what it is' })]));
    const rows = [];
    if (state.layer === 0) rows.push(['embed', 'token embedding (+ position)']);
    for (const [leaf, what] of BLOCK_PROBES) rows.push([`blocks.${state.layer}.${leaf}`, what]);
    if (state.layer === L - 1) rows.push(['final_norm', 'final norm, read by the LM head']);
    const t = state.token;
    for (const [name, what] of rows) {
      const d = probe(name);
      if (!d) continue;
      const v = d[t];
      const cellBox = el('td');
      if (Array.isArray(v) && Array.isArray(v[0])) {
        const axis = axesOf(name)[1] || 'head';
        const ids = axisIds(name, axis, v.length);
        v.forEach((hv, h) => { cellBox.append(el('div', { class: 'head-row' }, [el('span', { class: 'head-tag', text: `${axis === 'kv_head' ? 'kv' : 'h'}${ids[h]}` }), vector(hv, name, [t, ids[h]])])); });
      } else if (Array.isArray(v)) {
        cellBox.append(vector(v, name, [t]));
      }
      const tr = el('tr', {}, [el('td', { class: 'probe', text: name }), cellBox, el('td', { class: 'what', text: what })]);
      tr.dataset.probe = name;
      table.append(tr);
    }
    box.append(table);
  }

  // ------------------------------------------------------------------ 4 next token
  function drawNext() {
    const box = clear($('next'));
    const nx = P().next;
    if (!nx || !nx.length) { box.append(el('p', { class: 'muted', text: 'This trace holds no logits.' })); return; }
    nx.forEach((entry, t) => {
      const card = el('div', { class: 'next-card' });
      const upTo = range(t + 1).map(tokenLabel).join(' ');
      card.append(el('h3', { text: `after “${upTo}”`, title: upTo }));
      card.append(el('div', { class: 'cand head' }, [el('span', { text: 'next' }), el('span', { text: '' }), el('span', { text: 'prob' }), el('span', { text: 'logit' })]));
      for (const c of entry) {
        const bar = el('div', { class: 'bar' }, el('span', { style: { width: `${(100 * c.prob).toFixed(1)}%`, background: tokColor(t) } }));
        card.append(el('div', { class: 'cand' }, [
          el('span', { class: 'piece', text: c.label, title: `id ${c.id}` }), bar,
          num(c.prob, 'probs', [t, c.id]), num(c.logit, 'logits', [t, c.id]),
        ]));
      }
      box.append(card);
    });
  }

  // ------------------------------------------------------------------ 5 norm placement
  function drawNorm() {
    const box = clear($('norm'));
    const nm = P().norm;
    if (!nm) { box.append(el('p', { class: 'muted', text: 'No pre-norm/post-norm comparison in this page.' })); return; }
    const kinds = Object.keys(nm.rms);
    const steps = nm.steps, t = Math.min(state.token, nm.tokens.length - 1);
    const W = 560, H = 220, padL = 46, padB = 34, padT = 14;
    let maxV = 0; for (const k of kinds) for (const row of nm.rms[k]) for (const v of row) maxV = Math.max(maxV, v);
    // Round the axis up to a nice step (1, 2, 2.5 or 5 times a power of ten).
    const raw = Math.max(1.2, maxV * 1.05) / 4, pow = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10].map((m) => m * pow).find((v) => v >= raw);
    maxV = step * 4;
    const xs = (i) => padL + (W - padL - 20) * (steps.length > 1 ? i / (steps.length - 1) : 0.5);
    const ys = (v) => padT + (H - padT - padB) * (1 - v / maxV);
    const root = svg('svg', { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'RMS across blocks' });
    for (let g = 0; g <= 4; g++) {
      const v = maxV * g / 4;
      root.append(svg('line', { x1: padL, x2: W - 20, y1: ys(v), y2: ys(v), stroke: '#eef0f3' }));
      root.append(svg('text', { x: padL - 6, y: ys(v) + 4, 'text-anchor': 'end', fill: '#6b7280', 'font-size': 10.5, text: fmt(v) }));
    }
    steps.forEach((s, i) => root.append(svg('text', { x: xs(i), y: H - padB + 16, 'text-anchor': 'middle', fill: '#6b7280', 'font-size': 10.5, text: s })));
    const styles = { pre: ['#2f6fd6', ''], post: ['#d9822b', '6 4'] };
    kinds.forEach((k, ki) => {
      const row = nm.rms[k][t];
      const [col, dash] = styles[k] || [tokColor(ki + 3), ''];
      root.append(svg('polyline', { points: row.map((v, i) => `${xs(i)},${ys(v)}`).join(' '), fill: 'none', stroke: col, 'stroke-width': 2.2, 'stroke-dasharray': dash }));
      row.forEach((v, i) => root.append(svg('circle', { cx: xs(i), cy: ys(v), r: 3.5, fill: col })));
      root.append(svg('line', { x1: padL + 12, x2: padL + 34, y1: 18 + 16 * ki, y2: 18 + 16 * ki, stroke: col, 'stroke-width': 2.2, 'stroke-dasharray': dash }));
      root.append(svg('text', { x: padL + 40, y: 22 + 16 * ki, fill: col, 'font-size': 12, 'font-weight': 600, text: `${k}-norm` }));
    });
    box.append(el('p', { class: 'note', text: `Token “${tokenLabel(t)}”${nm.about ? ' · ' + nm.about : ''}` }), root);
    const table = el('table', { class: 'grid' });
    table.append(el('tr', {}, [el('th', { text: '' })].concat(steps.map((s) => el('th', { text: s })))));
    const calc = (k, i) => nm.calc && nm.calc[k] && nm.calc[k][t] ? nm.calc[k][t][i] : null;
    if (nm.calc && kinds.some((k) => nm.calc[k] && !nm.calc[k][t])) {  // drawn disabled until they come
      askPart(nm.fetch, [t], (p, rows) => { for (const k of Object.keys(rows)) p.norm.calc[k][t] = rows[k]; }, drawNorm);
    }
    for (const k of kinds) {
      table.append(el('tr', {}, [el('td', { class: 'probe', text: `${k}-norm` })].concat(
        nm.rms[k][t].map((v, i) => el('td', {}, calcNum(fmt(v), calc(k, i), { rms: k, token: String(t), step: String(i) }))))));
    }
    box.append(table);
  }

  // ------------------------------------------------------------------ 6 FlashAttention
  function storedWalk(layer, head, row, tile) {
    // One head's walk of one query row through the tiled kernel (tracing/tiles.py), stored
    // in the data by Python: the page computes no step of it.
    const fl = P().flash, w = fl && fl.walks ? fl.walks[`${layer}|${head}|${row}|${tile}`] : null;
    if (!w) return null;
    const rep = CFG().n_heads / CFG().n_kv_heads;
    const steps = w.steps.map((st) => (st.skipped ? { k0: st.k[0], k1: st.k[1], skipped: true }
      : { k0: st.k[0], k1: st.k[1], skipped: false, scores: st.scores, m: st.m, l: st.l, alpha: st.alpha, o: st.o }));
    const nK = w.steps.length ? w.steps[w.steps.length - 1].k[1] : T();
    return { steps, out: w.output || [], nK, qTile: Math.floor(row / tile), kvh: Math.floor(head / rep), sink: w.sink_weight };
  }
  function drawFlash() {
    const box = clear($('flash'));
    state.flashLayer = fillSelect($('flash-layer'), layerIds(), (i) => `${i}`, state.flashLayer, (v) => { state.flashLayer = v; state.flashStep = 0; drawFlash(); });
    if (!probe(`blocks.${state.flashLayer}.attn.scores`) || !probe(`blocks.${state.flashLayer}.attn.v`)) {
      box.append(el('p', { class: 'muted', text: 'This trace holds no scores and values to walk through.' })); return;
    }
    state.flashHead = fillSelect($('flash-head'), headIds(state.flashLayer), (i) => `${i}`, state.flashHead, (v) => { state.flashHead = v; state.flashStep = 0; drawFlash(); });
    const tiles = P().flash && P().flash.tiles && P().flash.tiles.length ? P().flash.tiles : [state.flashTile || 1];
    const ts = $('flash-tile'); clear(ts);
    for (const x of tiles) ts.append(el('option', { value: String(x), text: String(x) }));
    if (!tiles.includes(state.flashTile)) state.flashTile = tiles[Math.min(1, tiles.length - 1)];
    ts.value = String(state.flashTile);
    ts.onchange = () => { state.flashTile = Number(ts.value); state.flashStep = 0; drawFlash(); };
    const row = state.token, tile = state.flashTile, layer = state.flashLayer, head = state.flashHead;
    const run = storedWalk(layer, head, row, tile);
    if (!run) {
      $('flash-step').textContent = '';
      if (askPart(P().flash && P().flash.fetch, [row, tile], (p, body) => Object.assign(p.flash.walks, body.walks), drawFlash)) {
        box.append(el('p', { class: 'muted', text: `Running the tiled kernel for row “${tokenLabel(row)}” with tiles of ${tile}…` }));
        return;
      }
      box.append(el('p', { class: 'muted', text: `This page does not hold the tiled kernel’s walk of row “${tokenLabel(row)}” with tiles of ${tile} (a page keeps a bounded number of walks; trace with --attention tiled --query ${row} --tile ${tile}, or open the model with glassformer view).` }));
      return;
    }
    const live = run.steps.filter((s) => !s.skipped);
    state.flashStep = Math.max(0, Math.min(state.flashStep, live.length - 1));
    const nqT = Math.ceil(T() / tile), nkT = Math.ceil(run.nK / tile);
    let gridSkipped = 0;
    for (let a = 0; a < nqT; a++) for (let b = 0; b < nkT; b++) if (b * tile > Math.min((a + 1) * tile, T()) - 1) gridSkipped++;
    $('flash-step').textContent = `step ${state.flashStep + 1} of ${live.length} on this row · ${gridSkipped} of ${nqT * nkT} tiles skipped`;
    $('flash-prev').onclick = () => { state.flashStep = Math.max(0, state.flashStep - 1); drawFlash(); };
    $('flash-next').onclick = () => { state.flashStep = Math.min(live.length - 1, state.flashStep + 1); drawFlash(); };
    const cur = live[state.flashStep];
    // The full tile grid: query tiles × key tiles; the traced row's tile row is outlined.
    const nq = Math.ceil(T() / tile), nk = Math.ceil(run.nK / tile);
    box.append(el('p', { class: 'note', text: `Query row “${tokenLabel(row)}” (position ${row}) of layer ${layer}, head ${head}, reading KV head ${run.kvh}; tiles of ${tile}×${tile}. Pick another row by clicking a token above.` }));
    const grid = el('div', { class: 'tiles', style: { gridTemplateColumns: `auto repeat(${nk}, minmax(70px, 1fr))` } });
    grid.append(el('div'));
    for (let b = 0; b < nk; b++) grid.append(el('div', { class: 'muted', style: { fontSize: '11px' }, text: `keys ${range(Math.min(tile, run.nK - b * tile)).map((q) => tokenLabel(b * tile + q)).join(' ')}` }));
    for (let a = 0; a < nq; a++) {
      grid.append(el('div', { class: 'muted', style: { fontSize: '11px', paddingRight: '6px' }, text: `queries ${range(Math.min(tile, T() - a * tile)).map((q) => tokenLabel(a * tile + q)).join(' ')}` }));
      for (let b = 0; b < nk; b++) {
        const skipped = b * tile > Math.min((a + 1) * tile, T()) - 1;
        let cls = 'tile' + (skipped ? ' skipped' : '');
        const children = [];
        if (a === run.qTile) {
          cls += ' row';
          const st = run.steps[b];
          const li = live.indexOf(st);
          if (!st.skipped && li < state.flashStep) cls += ' done';
          if (st === cur) cls += ' current';
          if (!st.skipped) children.push(el('div', { text: `s = ${st.scores.map((x) => (x === null ? '·' : fmt(x))).join(', ')}` }));
        }
        if (skipped) children.push(el('div', { text: 'skipped' }));
        const tdiv = el('div', { class: cls }, children);
        tdiv.dataset.qtile = String(a); tdiv.dataset.ktile = String(b);
        grid.append(tdiv);
      }
    }
    box.append(grid);
    const table = el('table', { class: 'grid' });
    table.append(el('tr', {}, ['key tile', 'scaled scores (· = masked)', 'm', 'α = exp(m_old − m)', 'l', 'o'].map((h) => el('th', { text: h }))));
    // Every number of the walk opens its own calculation (computed here from the step before
    // it and the traced scores and values, which link to theirs).
    const sName = `blocks.${layer}.attn.scores`, vName = `blocks.${layer}.attn.v`;
    const V = probe(vName), vp = kvPos(layer, vName, head);
    const scoreOps = (st) => st.scores.map((x, q) => (x === null ? null : { label: `s[${tokenLabel(row)}][${tokenLabel(st.k0 + q)}]`, source: 'probe', name: sName, index: [row, head, st.k0 + q], value: x })).filter(Boolean);
    const flashCalcs = (st, prev) => {
      const mPrev = prev ? prev.m : -Infinity, lPrev = prev ? prev.l : 0, oPrev = prev ? prev.o : null;
      const ops = scoreOps(st);
      const exps = ops.map((o) => `exp(${fmt(o.value)} − ${fmt(st.m)})`);
      const where = `after the key tile ${tokenLabel(st.k0)}…${tokenLabel(st.k1 - 1)}`;
      return {
        m: () => ({ title: `m ${where} = ${fmt(st.m)}`, op: 'max', operands: ops,
          text: `m = max(m before, scores of this tile) = max(${prev ? fmt(mPrev) : '−∞'}, ${ops.map((o) => fmt(o.value)).join(', ')}) = ${fmt(st.m)}` }),
        alpha: () => ({ title: `α ${where} = ${fmt(st.alpha)}`, op: 'rescale',
          text: `α = exp(m before − m) = exp(${fmt(mPrev)} − ${fmt(st.m)}) = ${fmt(st.alpha)}: what the sums so far are worth now` }),
        l: () => ({ title: `l ${where} = ${fmt(st.l)}`, op: 'sum', operands: ops,
          text: `l = α·l before + Σ exp(s − m) = ${prev ? `${fmtP(st.alpha)}·${fmtP(lPrev)}` : '0'} + ${exps.join(' + ')} = ${fmt(st.l)}` }),
        o: (d) => () => {
          const vOps = ops.map((o) => ({ label: `v[${tokenLabel(o.index[2])}][${d}]`, source: 'probe', name: vName, index: [o.index[2], Math.floor(head / (CFG().n_heads / CFG().n_kv_heads)), d], value: V ? V[o.index[2]][vp][d] : undefined }));
          const terms = ops.map((o, q) => `exp(${fmt(o.value)} − ${fmt(st.m)})·${fmtP(vOps[q].value)}`);
          return { title: `o[${d}] ${where} = ${fmt(st.o[d])}`, op: 'sum', operands: ops.concat(vOps),
            text: `o[${d}] = α·o before + Σ exp(s − m)·v = ${prev ? `${fmtP(st.alpha)}·${fmtP(oPrev[d])}` : '0'} + ${terms.join(' + ')} = ${fmt(st.o[d])}` };
        },
      };
    };
    run.steps.forEach((st) => {
      const li = live.indexOf(st);
      if (!st.skipped && li > state.flashStep) return;
      const keys = range(st.k1 - st.k0).map((q) => tokenLabel(st.k0 + q)).join(' ');
      if (st.skipped) { table.append(el('tr', {}, [el('td', { text: keys }), el('td', { class: 'muted', text: 'fully masked: skipped, nothing computed', colspan: 5 })])); return; }
      const c = flashCalcs(st, li > 0 ? live[li - 1] : null);
      const sc = el('td');
      st.scores.forEach((x, q) => { if (q) sc.append(', '); sc.append(x === null ? '·' : num(x, sName, [row, head, st.k0 + q])); });
      const oc = el('td', {}, el('span', { class: 'vec' }, st.o.slice(0, FEATURE_CAP).map((x, d) => num(x, 'flash.o', [d], { local: c.o(d) }))));
      const tr = el('tr', { class: st === cur ? 'hl' : '' }, [
        el('td', { text: keys }), sc, el('td', {}, num(st.m, 'flash.m', [li], { local: c.m })),
        el('td', {}, li === 0 ? '— (first tile)' : num(st.alpha, 'flash.alpha', [li], { local: c.alpha })),
        el('td', {}, num(st.l, 'flash.l', [li], { local: c.l })), oc,
      ]);
      table.append(tr);
    });
    box.append(table);
    if (state.flashStep === live.length - 1) {
      const z = probe(`blocks.${layer}.attn.z`);
      const zp = axisIds(`blocks.${layer}.attn.z`, 'head', CFG().n_heads).indexOf(head);
      const zt = z && zp >= 0 ? z[row][zp] : null;
      const same = zt && zt.every((x, d) => Math.abs(x - run.out[d]) <= 1e-4 * (1 + Math.abs(x)));
      // with a sink, its weight joins l after the last tile: the keys keep 1 − that weight (attention/tiled.py)
      const form = run.sink == null ? 'o / l' : `o / l · (1 − sink weight ${fmt(run.sink)})`;
      const p = el('p', {}, [`Result ${form} = [${run.out.slice(0, FEATURE_CAP).map(fmt).join(', ')}]`]);
      if (zt) { p.append(' · traced z = ', vector(zt, `blocks.${layer}.attn.z`, [row, head]), ' ', el('span', { class: same ? 'ok' : 'bad', text: same ? '✓ the same' : '✗ differs' })); }
      box.append(p);
    }
    box.append(el('p', { class: 'note', text: 'Read from the tiled kernel’s own log (attention/tiled.py, walked by tracing/tiles.py).' }));
  }

  // ------------------------------------------------------------------ 7 decode
  function drawDecode() {
    const box = clear($('decode'));
    const layer = state.decLayer = fillSelect($('dec-layer'), layerIds(), (i) => `${i}`, state.decLayer, (v) => { state.decLayer = v; drawDecode(); });
    const head = state.decHead = fillSelect($('dec-head'), headIds(layer), (i) => `${i}`, state.decHead, (v) => { state.decHead = v; drawDecode(); });
    const kName = hasProbe(`blocks.${layer}.attn.k_rot`) ? `blocks.${layer}.attn.k_rot` : `blocks.${layer}.attn.k`;
    const vName = `blocks.${layer}.attn.v`, sName = `blocks.${layer}.attn.scores`, wName = `blocks.${layer}.attn.weights`;
    const qName = hasProbe(`blocks.${layer}.attn.q_rot`) ? `blocks.${layer}.attn.q_rot` : `blocks.${layer}.attn.q`;
    const K = probe(kName), V = probe(vName), S = probe(sName), Wt = probe(wName), Q = probe(qName);
    if (!K || !V || !S || !Wt) { box.append(el('p', { class: 'muted', text: 'This trace holds no keys, values and scores for this layer.' })); return; }
    const nT = T(), last = nT - 1, rep = CFG().n_heads / CFG().n_kv_heads, kvh = Math.floor(head / rep);
    const hp = headIds(layer).indexOf(head), kp = kvPos(layer, kName, head), vp = kvPos(layer, vName, head);
    const qp = axisIds(qName, 'head', CFG().n_heads).indexOf(head);
    const perToken = 2 * CFG().n_layers * CFG().n_kv_heads * CFG().head_dim;
    box.append(el('p', { class: 'note', text: `The newest token “${tokenLabel(last)}” (position ${last}) is decoded with the cache of the ${last} before it. Query head ${head} reads KV head ${kvh}; the cache holds 2 × ${CFG().n_layers} layers × ${CFG().n_kv_heads} KV heads × ${CFG().head_dim} = ${perToken} numbers per token.` }));
    const left = el('div'), right = el('div');
    const table = el('table', { class: 'grid' });
    table.append(el('tr', {}, ['pos', 'token', `key (${kName.split('.').pop()})`, 'value'].map((h) => el('th', { text: h }))));
    for (let j = 0; j < nT; j++) {
      const tr = el('tr', { class: j === last ? 'hl' : '' }, [
        el('td', { text: String(j) }), el('td', { text: tokenLabel(j) + (j === last ? '  ← new' : '') }),
        el('td', {}, vector(K[j][kp], kName, [j, kvh])), el('td', {}, vector(V[j][vp], vName, [j, kvh])),
      ]);
      table.append(tr);
    }
    left.append(el('h3', { class: 'muted', style: { fontSize: '13px' }, text: `KV cache, layer ${layer}, KV head ${kvh}` }), table);
    right.append(el('h3', { class: 'muted', style: { fontSize: '13px' }, text: 'The new row' }));
    if (Q && qp >= 0) right.append(el('p', {}, ['query ', vector(Q[last][qp], qName, [last, head])]));
    const rt = el('table', { class: 'grid' });
    rt.append(el('tr', {}, ['key', 'scaled score', 'weight'].map((h) => el('th', { text: h }))));
    for (let j = 0; j < S[last][hp].length; j++) {
      rt.append(el('tr', {}, [el('td', { text: tokenLabel(j) }), el('td', {}, num(S[last][hp][j], sName, [last, head, j])),
        el('td', {}, Wt[last][hp][j] === null ? el('span', { class: 'muted', text: 'masked' }) : num(Wt[last][hp][j], wName, [last, head, j]))]));
    }
    right.append(rt);
    if (last > 0) {
      const prev = last - 1;
      right.append(el('p', { class: 'note', text: `Earlier rows are not recomputed: “${tokenLabel(prev)}” still puts ${fmt(Wt[prev][hp][prev])} of its weight on itself, as before the new token arrived.` }));
    }
    box.append(el('div', { class: 'split' }, [left, right]));
  }

  // ------------------------------------------------------------------ 8 costs
  function costValue(k, v) {
    if (typeof v !== 'number') return String(v);
    if (/bytes/.test(k)) return `${fmtBytes(v)} (${fmtInt(v)})`;
    if (/seconds/.test(k)) return v < 120 ? `${fmt(v)} s` : v < 7200 ? `${fmt(v / 60)} min` : v < 172800 ? `${fmt(v / 3600)} h` : `${fmt(v / 86400)} days`;
    if (/flops/.test(k)) return `${fmtBig(v)}${Math.abs(v) < 1000 ? ' ' : ''}FLOP (${v.toExponential(3)})`;
    if (Number.isInteger(v) && Math.abs(v) >= 1000) return `${fmtInt(v)} (${fmtBig(v)})`;
    return fmt(v);
  }
  function drawCosts() {
    const box = clear($('costs'));
    const c = P().costs;
    if (!c) { box.append(el('p', { class: 'muted', text: 'No cost figures in this page.' })); return; }
    if (c.about) box.append(el('p', { class: 'note', text: c.about }));
    const table = el('table', { class: 'grid' });
    table.append(el('tr', {}, ['figure', 'value'].map((h) => el('th', { text: h }))));
    const rows = c.rows || [];
    for (const r of rows) {
      const val = r.calc ? calcNum(costValue(r.key, r.value), r.calc, { cost: r.key }) : costValue(r.key, r.value);
      const tr = el('tr', {}, [el('td', { class: 'probe', text: r.key }), el('td', {}, val), el('td', { class: 'what', text: r.what || '' })]);
      tr.dataset.key = r.key;
      table.append(tr);
    }
    box.append(table);
  }

  // ------------------------------------------------------------------ 3b calculations
  function explainKey(probeName, index) { return `${probeName}|${index.join(',')}`; }
  async function explain(probeName, index, fresh) {
    const key = explainKey(probeName, index);
    markActive(probeName, index);
    const stored = P().explain && P().explain[key];
    if (stored) { showCalc(stored, fresh); return; }
    if (P().mode === 'server') {
      try {
        const res = await fetch('api/explain', { method: 'POST', headers: { 'Content-Type': 'application/json' },
          body: JSON.stringify({ text: P().sentence, probe: probeName, index, checkpoint: P().checkpoint }) });
        const body = await res.json();
        if (!res.ok) { showCalc({ title: `${probeName}${idxLabel(probeName, index)}`, text: errorText(body, res.status) }, fresh); return; }
        P().explain = P().explain || {};
        P().explain[key] = body;
        showCalc(body, fresh);
      } catch (e) { showCalc({ title: `${probeName}${idxLabel(probeName, index)}`, text: `could not reach the server: ${e}` }, fresh); }
      return;
    }
    showCalc({ title: `${probeName}${idxLabel(probeName, index)}`,
      text: 'This saved page stores the calculations of the numbers it shows first; open the model with `glassformer view` to compute this one.' }, fresh);
  }
  function markActive(probeName, index) {
    document.querySelectorAll('.num.active').forEach((b) => b.classList.remove('active'));
    const sel = `.num[data-probe="${CSS.escape(probeName)}"][data-index="${CSS.escape(JSON.stringify(index))}"]`;
    document.querySelectorAll(sel).forEach((b) => b.classList.add('active'));
  }
  // An explain result (docs/trace-format.md "explain results"): steps, each with operands
  // {label, source, name, index, value}; operands read from probes link to their own
  // calculation. Results of other shapes (the page's own RMS) use title/text/operands.
  function operandSpan(o) {
    const name = o.name || o.probe;
    const idx = Array.isArray(o.index) ? o.index : null;
    const isProbe = (o.source === 'probe' || (!o.source && name)) && name && idx;
    const label = o.label || (name ? `${name}${idx ? idxLabel(name, idx) : ''}` : '?');
    const where = o.source === 'twin' ? `${name}${idx ? '[' + idx.join(', ') + ']' : ''} of the other model traced for this comparison (not this page’s trace)` : o.what ? `${o.label}: ${o.what}` : o.source === 'weight' ? `weight ${name}[${idx ? idx.join(', ') : ''}]` : o.source === 'step' ? `the value of step ${idx ? idx[0] + 1 : ''}` : o.source === 'const' ? 'a constant' : `${name}${idx ? idxLabel(name, idx) : ''}: click for its calculation`;
    const span = el('span', { class: 'operand', title: where });
    const shown = o.power === -1 ? `1/${label}` : label;
    if (isProbe) {
      const a = el('button', { class: 'link', type: 'button', text: shown });
      a.dataset.probe = name; a.dataset.index = JSON.stringify(idx);
      a.addEventListener('click', () => explain(name, idx, true));
      span.append(a);
    } else span.append(el('span', { class: o.source === 'weight' ? 'w' : 'c', text: shown }));
    if (o.value !== undefined && o.value !== null) span.append(el('span', { class: 'val', text: `=${Array.isArray(o.value) ? '[' + o.value.map(fmt).join(', ') + ']' : fmt(o.value)}` }));
    if (o.what) span.append(el('span', { class: 'what', text: o.what }));
    return span;
  }
  // What a step's unlisted entries are: a max keeps the largest of them (explaining/steps.py Steps.max),
  // a softmax the sum of their exp(x − m) in its denominator, a sum the sum of its smaller terms.
  function restText(st) {
    const n = st.rest.count, v = fmt(st.rest.value);
    if (st.op === 'max') return `… ${n} more ${n === 1 ? 'entry' : 'entries'} not listed, the largest of them ${v} (below the max)`;
    if (st.op === 'softmax') return `+ ${n} more ${n === 1 ? 'term' : 'terms'} exp(x − m) of the denominator, together ${v}`;
    return `+ ${n} smaller ${n === 1 ? 'term' : 'terms'}, together ${v}`;
  }
  function termsOf(step) {
    // One list item per term of a sum (its factors joined by ·); for a softmax or a max,
    // one item per entry of the row.
    const rows = [];
    for (const term of step.terms || []) rows.push(term);
    if (step.target) rows.push([step.target]);
    for (const o of step.over || []) if (!step.target || o.label !== step.target.label) rows.push([o]);
    for (const o of step.operands || []) rows.push([o]);
    return rows;
  }
  function showCalc(r, fresh) {
    if (fresh && state.current) state.history.push(state.current);
    state.current = r;
    $('explain-back').disabled = state.history.length === 0;
    const body = clear($('explain-body'));
    const probeName = r.probe, index = r.index;
    const head = r.title || ((r.label || (probeName ? `${probeName}${Array.isArray(index) ? idxLabel(probeName, index) : ''}` : 'calculation')) +
      (r.value !== undefined && r.value !== null ? ` = ${fmt(r.value)}` : ''));
    body.append(el('div', { class: 'calc-title', text: head }));
    const rmsOf = typeof probeName === 'string' && probeName.startsWith('rms:') ? probeName.slice(4) : null;
    const where = rmsOf ? `RMS of ${rmsOf}[${tokenLabel(index[0])}], the stream after an addition${r.model ? ', in ' + r.model : ''}` : `${probeName}${Array.isArray(index) ? idxLabel(probeName, index) : ''}`;
    if (probeName && r.label) body.append(el('div', { class: 'muted', style: { fontSize: '12px' }, text: where }));
    const steps = r.steps || [];
    const text = r.text || r.formula;
    if (text) body.append(el('pre', { class: 'calc-text', text }));
    steps.forEach((st, k) => {
      const rows = termsOf(st);
      const box = el('div', { class: 'calc-step' });
      box.append(el('div', { class: 'calc-step-head' }, [`step ${k + 1}: ${st.label || ''}`, st.op ? el('span', { class: 'calc-op', text: st.op + (st.post ? ` → ${st.post}` : '') }) : null]));
      if (st.formula) box.append(el('div', { class: 'muted', style: { fontFamily: 'var(--mono)', fontSize: '12px' }, text: st.formula }));
      if (st.reason) box.append(el('div', { class: 'muted', text: st.reason }));
      if (rows.length) {
        const ul = el('ul', { class: 'operands' });
        rows.slice(0, 40).forEach((term, ti) => {
          const li = el('li');
          if (st.op === 'sum' && ti > 0) li.append(el('span', { class: 'muted', text: '+ ' }));
          term.forEach((o, j) => { if (j) li.append(el('span', { class: 'muted', text: ' · ' })); li.append(operandSpan(o)); });
          ul.append(li);
        });
        if (rows.length > 40) ul.append(el('li', { class: 'muted', text: `… ${rows.length - 40} more` }));
        box.append(ul);
      }
      if (st.rest && st.rest.count) box.append(el('div', { class: 'muted', style: { fontSize: '12px' }, text: restText(st) }));
      if (st.max !== undefined && st.max !== null && st.op === 'softmax') box.append(el('div', { class: 'muted', style: { fontSize: '12px' }, text: `row max ${fmt(st.max)}` }));
      if (st.value !== undefined) box.append(el('div', {}, ['= ', el('b', { text: st.value === null ? 'masked' : fmt(st.value) })]));
      body.append(box);
    });
    if (!steps.length && r.operands && r.operands.length) {
      body.append(el('div', { class: 'muted', style: { marginTop: '8px' }, text: 'operands' }));
      const ul = el('ul', { class: 'operands' });
      r.operands.forEach((o) => ul.append(el('li', {}, operandSpan(o))));
      body.append(ul);
    }
    if (typeof r.result === 'number' && typeof r.value === 'number') {
      const same = Math.abs(r.result - r.value) <= 1e-5 * (1 + Math.abs(r.value));
      const ref = r.ref || (r.key ? 'glassformer.cost’s figure' : 'the traced value');
      body.append(el('p', { class: same ? 'ok' : 'bad', text: `recomputed ${fmt(r.result)} ${same ? '= ' + ref + ' ✓' : '≠ ' + ref + ' ' + fmt(r.value)}` }));
    }
  }
  $('explain-back').addEventListener('click', () => {
    if (!state.history.length) return;
    state.current = null;
    showCalc(state.history.pop(), false);
  });

  // ------------------------------------------------------------------ 9 sampling
  // The controls as /api/sample reads them (an off filter: null). The page never samples: every
  // stage, and the draw, come from the server's run of the project's sampler (sampling_stages).
  const SAMPLE_OUTPUTS = [['sample-temperature', 'sample-temperature-out'], ['sample-top-p', 'sample-top-p-out'],
    ['sample-min-p', 'sample-min-p-out'], ['sample-penalty', 'sample-penalty-out']];
  const SAMPLE_SHOWN = 10; // bars drawn per stage (the answer lists up to 200 ids)
  const STAGE_TITLES = { logits: 'raw logits', repetition_penalty: 'repetition penalty', temperature: '÷ temperature',
    top_k: 'top-k cut', top_p: 'top-p cumulative cut', min_p: 'min-p threshold', probs: 'renormalised probabilities' };
  let sampleAsked = 0, sampleTimer = null;
  // A saved page holds the sampler's answers for a grid of settings (viewer/source.py sample_grid):
  // its temperature and top-p sliders step over the grid's values (the slider's value is the index),
  // and the other controls rest at the grid's defaults. SLIDERS: [slider, the grid's values].
  const GRID_SLIDERS = [['sample-temperature', 'temperature'], ['sample-top-p', 'top_p']];
  const liveRanges = {}; // each slider's range as page.html sets it, for a live page
  function sampleGrid() { const p = P(); return p.mode !== 'server' && p.sampling ? p.sampling : null; }
  function setSliders(grid) {
    for (const [id, key] of GRID_SLIDERS) {
      const input = $(id), onGrid = input.dataset.grid === '1';
      if (!liveRanges[id]) liveRanges[id] = { min: input.min, max: input.max, step: input.step, value: input.value };
      if (grid && !onGrid) {
        const values = grid[key], at = values.indexOf(Number(liveRanges[id].value));
        Object.assign(input, { min: '0', max: String(values.length - 1), step: '1' });
        input.value = String(at >= 0 ? at : values.length - 1);
        input.dataset.grid = '1';
      } else if (!grid && onGrid) {
        Object.assign(input, liveRanges[id]);
        delete input.dataset.grid;
      }
    }
  }
  function sampleSettings() {
    const whole = (id) => Math.max(0, Math.floor(Number($(id).value) || 0));
    const grid = sampleGrid();
    if (grid) {
      const p = grid.top_p[whole('sample-top-p')];
      return Object.assign({ temperature: grid.temperature[whole('sample-temperature')], top_p: p < 1 ? p : null }, grid.defaults);
    }
    const k = whole('sample-top-k'), p = Number($('sample-top-p').value), m = Number($('sample-min-p').value);
    return { temperature: Number($('sample-temperature').value), top_k: k > 0 ? k : null, top_p: p < 1 ? p : null,
      min_p: m > 0 ? m : null, repetition_penalty: Number($('sample-penalty').value), seed: whole('sample-seed') };
  }
  function drawSample() {
    const box = $('sample'), t = state.token, p = P(), grid = sampleGrid(), live = p.mode === 'server';
    setSliders(grid);
    const settings = sampleSettings();
    for (const [input, out] of SAMPLE_OUTPUTS) $(out).textContent = $(input).value;
    if (grid) { $('sample-temperature-out').textContent = fmt(settings.temperature); $('sample-top-p-out').textContent = fmt(settings.top_p === null ? 1 : settings.top_p); }
    $('sample-token').textContent = `next after token ${t}: ${tokenLabel(t)}`;
    $('sample-controls').querySelectorAll('input').forEach((i) => { i.disabled = !live && !(grid && i.dataset.grid === '1'); });
    if (!live) { drawSavedSample(box, grid, settings, t); return; }
    const seq = ++sampleAsked;
    box.classList.add('stale');
    fetch('api/sample', { method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify(Object.assign({ text: p.sentence, position: t, checkpoint: p.checkpoint }, settings)) })
      .then(async (res) => {
        const body = await res.json();
        if (seq !== sampleAsked || P() !== p) return; // a later move or sentence draws its own answer
        if (!res.ok) { message(errorText(body, res.status)); return; }
        drawStages(body, settings, t);
      })
      .catch((e) => { if (seq === sampleAsked) message(`could not reach the server: ${e}`); });
  }
  // A saved page draws the grid's answer for the sliders' settings (the server's, stored when the page was written).
  function drawSavedSample(box, grid, settings, t) {
    if (!grid) {
      clear(box).append(el('p', { class: 'muted', text: 'The sampling view asks the server: run `glassformer view` to move its controls.' }));
      return;
    }
    const key = `${t}|${$('sample-temperature').value}|${$('sample-top-p').value}`, held = grid.answers[key];
    if (!held) {
      const which = grid.positions.map((i) => `${i} (${tokenLabel(i)})`).join(', ');
      clear(box).append(el('p', { class: 'muted', text: `This saved page holds the sampling view of tokens ${which}: select one of them, or run \`glassformer view\` for any token.` }));
      return;
    }
    // Each stage and each stage's calculations are stored once (grid.shared) and named by their place.
    const ans = Object.assign({}, held, { stages: held.stages.map((r) => grid.shared[r]),
      calcs: Object.fromEntries(Object.entries(held.calcs).map(([name, r]) => [name, grid.shared[r]])) });
    drawStages(ans, settings, t);
    box.append(el('p', { class: 'note', text: `A saved page: the sliders step over the ${grid.temperature.length} × ${grid.top_p.length} settings it holds (temperature ${grid.temperature.map(fmt).join(', ')}; top-p ${grid.top_p.map(fmt).join(', ')}, 1 off); top-k and min-p off, repetition penalty 1, seed 0; each stage's first ${grid.shown} ids. Run \`glassformer view\` for any setting.` }));
  }
  function stageRow(st, j, ans, seen, piece) {
    const id = st.ids[j], prob = st.probs[j], val = st.values[j], top = st.probs[0] || 1;
    const cls = 'cand sample-bar' + (st.name === 'probs' && id === ans.chosen ? ' chosen' : '') + (seen.has(id) ? ' seen' : '');
    const row = el('div', { class: cls, title: `id ${id}\n${st.kind === 'logits' ? 'logit' : 'probability'} ${val}\nprobability ${prob}` }, [
      el('span', { class: 'piece', text: (seen.has(id) ? '• ' : '') + piece(id) }),
      el('div', { class: 'bar' }, el('span', { style: { width: `${(100 * prob / top).toFixed(1)}%` } })),
      el('span', { class: 'val', text: fmt(val) })]);
    Object.assign(row.dataset, { id: String(id), prob: String(prob), value: String(val) });
    // Its calculation as the server wrote it (the last stage's: the whole chain; another's: that stage's step).
    const calc = st.name === 'probs' ? (ans.calc || {})[String(id)] : ((ans.calcs || {})[st.name] || {})[String(id)];
    if (calc) { // shown on a click or Enter
      Object.assign(row, { tabIndex: 0 });
      row.setAttribute('role', 'button');
      row.classList.add('clickable');
      const shown = Object.assign({ ref: 'the sampler’s value' }, calc);
      row.addEventListener('click', () => showCalc(shown, true));
      row.addEventListener('keydown', (ev) => { if (ev.key === 'Enter' || ev.key === ' ') { ev.preventDefault(); showCalc(shown, true); } });
    }
    return row;
  }
  // How many ids a stage keeps: 'all' when it cut nothing (the raw logits, a filter that is off).
  function keptText(kept) {
    const V = CFG().vocab_size;
    if (kept === V) return `all ${fmtInt(kept)} ids kept (none cut)`;
    return `${fmtInt(kept)} ${kept === 1 ? 'id' : 'ids'} kept` + (V ? ` of ${fmtInt(V)}` : '');
  }
  function drawStages(ans, settings, t) {
    const box = clear($('sample'));
    box.classList.remove('stale');
    Object.assign(box.dataset, { position: String(t), chosen: String(ans.chosen), settings: JSON.stringify(settings) });
    const piece = (id) => { const s = (ans.labels || ans.pieces)[String(id)]; return s === undefined ? `#${id}` : String(s); };
    const grid = el('div', { class: 'stages' });
    for (const st of ans.stages) {
      const card = el('div', { class: 'stage-card' });
      card.dataset.stage = st.name;
      card.append(el('h3', { text: STAGE_TITLES[st.name] || st.name }));
      card.append(el('p', { class: 'note', text: keptText(st.kept) }));
      const seen = new Set(st.seen || []), shown = Math.min(SAMPLE_SHOWN, st.ids.length);
      for (let j = 0; j < shown; j++) card.append(stageRow(st, j, ans, seen, piece));
      // The kept ids not drawn: what they hold together (the listed ones past the bars, and the answer's rest).
      const unshown = st.probs.slice(shown).reduce((a, b) => a + b, 0) + (st.rest || 0);
      if (st.kept > shown) card.append(el('p', { class: 'note', text: `… ${fmtInt(st.kept - shown)} more kept, together probability ${fmt(unshown)}` }));
      grid.append(card);
    }
    box.append(grid);
    box.append(el('p', { class: 'ok', text: `The draw with seed ${settings.seed} picks “${piece(ans.chosen)}” (id ${ans.chosen}): the first token generate gives with these settings.` }));
  }
  $('sample-controls').querySelectorAll('input').forEach((input) => input.addEventListener('input', () => {
    clearTimeout(sampleTimer);
    sampleTimer = setTimeout(drawSample, 60); // a dragged slider asks once it rests
  }));

  // ------------------------------------------------------------------ a new sentence
  $('sentence-form').addEventListener('submit', async (ev) => {
    ev.preventDefault();
    if (P().mode !== 'server') return;
    const text = $('sentence').value;
    $('busy').hidden = false; $('run').disabled = true;
    try {
      const res = await fetch('api/trace', { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ text, checkpoint: P().checkpoint }) });
      const body = await res.json();
      if (!res.ok) { message(errorText(body, res.status)); return; }
      message('');
      state.payload = body;
      state.token = defaultToken();
      state.history = []; state.current = null;
      drawAll();
    } catch (e) {
      message(`could not reach the server: ${e}`);
    } finally { $('busy').hidden = true; $('run').disabled = false; }
  });

  function defaultToken() {
    const f = P().focus_token;
    return typeof f === 'number' && f >= 0 && f < T() ? f : T() - 1;
  }
  function drawAll() {
    // Layer and head choices are checked against the new trace by fillSelect as each view draws.
    const kt = Object.entries(TR().probes).find(([n]) => n.endsWith('.attn.tiles'));
    if (P().flash_tile) state.flashTile = P().flash_tile;
    else if (kt && kt[1].tile_size) state.flashTile = kt[1].tile_size;
    const sections = [drawHeader, drawTokens, drawLanes, drawAttention, drawNumbers, drawNext, drawNorm, drawFlash, drawDecode, drawCosts, drawSample];
    for (const f of sections) {
      try { f(); } catch (e) { console.error(e); message(`could not draw part of the page: ${e}`); }
    }
    eachView('draw');
    if (P().message) message(P().message);
    document.body.dataset.ready = String(Number(document.body.dataset.ready || 0) + 1);
  }
  // The views in their own files (render.VIEW_SCRIPTS: tokenizer.js, generated.js, ...) run
  // after this one and register with Glass.view({draw, onToken}); the page draws once they have.
  const views = [];
  function eachView(hook) {
    for (const v of views) {
      if (typeof v[hook] !== 'function') continue;
      try { v[hook](); } catch (e) { console.error(e); message(`could not draw part of the page: ${e}`); }
    }
  }
  window.Glass = Object.freeze({
    el, svg, clear, append, fmt, fmtP, fmtInt, fmtBytes, tokColor, range, $, message, errorText,
    state, P, TR, CFG, tokenLabel, showCalc, calcNum, drawAll, num, vector,
    // For the map and the walk (map.js, tour.js): choose the token or layer as the page's own controls do.
    selectToken(i) { if (i !== state.token) document.querySelector(`#tokens .tok[data-token="${i}"]`).click(); },
    selectLayer(i) { if (i !== state.layer) { state.layer = i; drawAttention(); drawNumbers(); } },
    setPayload(body) { state.payload = body; state.token = defaultToken(); state.history = []; state.current = null; drawAll(); },
    view(v) { views.push(v); },
  });
  function start() { state.token = defaultToken(); drawAll(); }
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else setTimeout(start, 0);
})();
