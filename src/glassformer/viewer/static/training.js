// glassformer explorer, view 12: Training (`glassformer view --run RUN`).
//
// The run's curves from metrics.jsonl (loss and bits per byte, train and held-out; the per-layer
// statistics of --stats-every), and a checkpoint slider over the run's checkpoints (the snapshots
// of --snapshot-every and the ones pruning kept): moving it asks the server to trace the same
// sentence with that checkpoint's weights (POST api/trace with "checkpoint") and swaps the page's
// data, so every view (attention maps, head summaries, numbers, next tokens) redraws at that
// checkpoint; this view adds the logit lens of it, and for a mixture of experts each expert's load.
// The data comes from GET api/run.
// As in glass.js, every text from the data reaches the page through textContent.
'use strict';
(function () {
  const G = window.Glass;
  const { el, svg, clear, fmt, $ } = G;
  const STAT_TITLES = { grad_norm: 'gradient norm', update_rms_ratio: 'update RMS / weight RMS',
    stream_rms: 'residual stream RMS', attn_entropy: 'attention entropy (nats) per head',
    induction_score: 'induction score per head (demo --induction)' };
  const view = { data: null, asked: false, kind: null, group: 'all', seq: 0, timer: null, drawn: 0 };

  // ------------------------------------------------------------------ the section's frame
  function frame() {
    const sec = $('view-training');
    if (sec.dataset.built) return sec;
    sec.dataset.built = '1';
    sec.append(
      el('h2', {}, [el('span', { class: 'n', text: '12' }), 'Training']),
      el('p', { class: 'lede', text: 'How this run learned: the loss and bits per byte at every logged step and evaluation, the per-layer statistics, and a slider over the run\u2019s checkpoints. Moving the slider traces the same sentence with that checkpoint\u2019s weights, so the attention maps, head summaries, numbers and next tokens above, and the logit lens below, show the model as it was at that step.' }),
      el('div', { class: 'controls' }, [
        el('label', { for: 'train-ckpt' }, 'checkpoint'),
        el('input', { id: 'train-ckpt', type: 'range', min: '0', max: '0', step: '1', value: '0', 'aria-label': 'checkpoint' }),
        el('span', { id: 'train-ckpt-out', class: 'pill' }),
        el('button', { id: 'train-reload', type: 'button', text: '↻ re-read the run', title: 'a run still training: its new lines and checkpoints' })]),
      el('div', { id: 'train-ckpts', class: 'ckpts' }),
      el('div', { class: 'train-charts' }, [el('div', { id: 'train-loss', class: 'train-chart' }), el('div', { id: 'train-bpb', class: 'train-chart' })]),
      el('h3', { text: 'Per-layer statistics' }),
      el('div', { class: 'controls' }, [el('label', {}, ['statistic ', el('select', { id: 'train-stat' })]),
        el('label', {}, ['weights ', el('select', { id: 'train-stat-group' })])]),
      el('div', { id: 'train-stats', class: 'train-chart wide' }),
      el('div', { id: 'train-moe', hidden: true }, [
        el('h3', { text: 'Mixture of experts: each expert\u2019s load' }),
        el('p', { class: 'note', text: 'Per mixture layer, the share of the routed slots (k per token) each expert took in the last forward of a logged step: at the chosen checkpoint\u2019s step, or the latest. An even load is 1/E each; the load-balancing loss (E\u00b7\u03a3 f\u00b7P per layer, summed; k at an even load) is what training adds, times router_aux_loss_coef, to keep it so.' }),
        el('div', { id: 'train-moe-load', class: 'scroll' }),
        el('div', { id: 'train-moe-aux', class: 'train-chart wide' })]),
      el('h3', { text: 'Logit lens at this checkpoint' }),
      el('p', { class: 'note', text: 'The stream leaving each block, through the final norm and the LM head: the most likely next token at every position (shade: its probability). Hover a cell for the top three.' }),
      el('div', { id: 'train-lens', class: 'scroll' }),
      el('h3', { text: 'One optimizer update, explained' }),
      el('div', { class: 'controls' }, [el('label', {}, ['weight ', el('select', { id: 'train-param' })]),
        el('label', {}, ['element ', el('input', { id: 'train-index', type: 'text', size: '8', spellcheck: 'false' })]),
        el('button', { id: 'train-update', type: 'button', text: 'explain the update' }),
        el('span', { id: 'train-update-step', class: 'note' })]));
    const slider = $('train-ckpt');
    slider.addEventListener('input', () => {
      showChosen();
      clearTimeout(view.timer);
      view.timer = setTimeout(() => goTo(names()[Number(slider.value)]), 120); // a dragged slider asks once it rests
    });
    $('train-update').addEventListener('click', askUpdate);
    $('train-reload').addEventListener('click', () => { view.asked = false; fetchRun(); });
    return sec;
  }

  // ------------------------------------------------------------------ data
  function names() { return view.data ? view.data.checkpoints.map((c) => c.name) : []; }
  function current() { return G.P().checkpoint || null; }
  function fetchRun() {
    if (view.asked) return;
    view.asked = true;
    fetch('api/run').then(async (res) => {
      const body = await res.json();
      if (!res.ok) { G.message(G.errorText(body, res.status)); return; }
      view.data = body;
      draw();
    }).catch((e) => G.message(`could not reach the server: ${e}`));
  }
  // The same sentence at another checkpoint: the page's data is swapped and every view redrawn
  // (the selected token stays: the sentence, and so its tokens, are the same).
  function goTo(name) {
    if (!name || name === current()) return;
    const p = G.P(), seq = ++view.seq;
    $('view-training').classList.add('stale');
    fetch('api/trace', { method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ text: p.sentence, checkpoint: name }) })
      .then(async (res) => {
        const body = await res.json();
        if (seq !== view.seq) return; // a later move draws its own answer
        $('view-training').classList.remove('stale');
        if (!res.ok) { G.message(G.errorText(body, res.status)); draw(); return; }
        G.message('');
        const s = G.state;
        s.payload = body; s.history.length = 0; s.current = null;
        clear($('explain-body')).append(el('p', { class: 'muted', text: `Now at ${name}: click any number to see how it was computed.` }));
        G.drawAll();
      })
      .catch((e) => { $('view-training').classList.remove('stale'); G.message(`could not reach the server: ${e}`); });
  }

  // ------------------------------------------------------------------ the checkpoint slider
  function describe(c) {
    const tags = [c.snapshot ? 'snapshot' : null, c.best ? 'best' : null, c.latest ? 'latest' : null].filter(Boolean);
    return `${c.name} (step ${c.step}${tags.length ? ', ' + tags.join(', ') : ''}` +
      (c.val_loss === null || c.val_loss === undefined ? ')' : `; held-out loss ${fmt(c.val_loss)})`);
  }
  function showChosen() {
    const c = view.data.checkpoints[Number($('train-ckpt').value)];
    $('train-ckpt-out').textContent = c ? describe(c) + (c.name === current() ? '' : ' …') : '';
  }
  function drawSlider() {
    const list = view.data.checkpoints, slider = $('train-ckpt'), at = names().indexOf(current());
    slider.max = String(Math.max(0, list.length - 1));
    slider.disabled = list.length < 2;
    if (at >= 0) slider.value = String(at);
    const out = $('train-ckpt-out');
    if (at >= 0) out.textContent = describe(list[at]);
    else if (current()) out.textContent = current();
    else if (G.P().run) out.textContent = 'the --checkpoint model (not one of this run\u2019s checkpoints): move the slider to open one';
    else out.textContent = 'this answer names no checkpoint (the model the page opened with): move the slider to open one';
    const box = clear($('train-ckpts'));
    list.forEach((c, i) => {
      const b = el('button', { type: 'button', class: 'ckpt' + (i === at ? ' sel' : '') + (c.snapshot ? ' snap' : ''),
        text: String(c.step), title: describe(c) });
      b.dataset.name = c.name;
      b.addEventListener('click', () => { slider.value = String(i); showChosen(); goTo(c.name); });
      box.append(b);
    });
  }

  // ------------------------------------------------------------------ line charts
  function extent(values) {
    const v = values.filter((x) => typeof x === 'number' && isFinite(x));
    if (!v.length) return null;
    let lo = Math.min(...v), hi = Math.max(...v);
    if (lo === hi) { lo -= Math.abs(lo) * 0.05 + 1e-9; hi += Math.abs(hi) * 0.05 + 1e-9; }
    return [lo, hi];
  }
  // series: [{name, x, y, color, dots}]; a null y breaks the line. The marker: the current checkpoint's step.
  function chart(box, title, series, marker, yLabel) {
    clear(box);
    box.append(el('div', { class: 'chart-title', text: title }));
    const xs = extent(series.flatMap((s) => s.x)), ys = extent(series.flatMap((s) => s.y));
    if (!xs || !ys) { box.append(el('p', { class: 'muted', text: 'nothing logged yet' })); return; }
    const W = 520, H = 210, L = 52, R = 10, T = 10, B = 28;
    const X = (x) => L + (W - L - R) * (xs[1] === xs[0] ? 0.5 : (x - xs[0]) / (xs[1] - xs[0]));
    const Y = (y) => T + (H - T - B) * (1 - (y - ys[0]) / (ys[1] - ys[0]));
    const root = svg('svg', { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: 'img', 'aria-label': title });
    for (let k = 0; k <= 4; k++) {
      const y = ys[0] + (ys[1] - ys[0]) * k / 4, x = xs[0] + (xs[1] - xs[0]) * k / 4;
      root.append(svg('line', { x1: L, x2: W - R, y1: Y(y), y2: Y(y), class: 'grid' }),
        svg('text', { x: L - 4, y: Y(y) + 4, 'text-anchor': 'end', class: 'tick', text: fmt(y) }),
        svg('text', { x: X(x), y: H - B + 14, 'text-anchor': 'middle', class: 'tick', text: String(Math.round(x)) }));
    }
    root.append(svg('text', { x: W - R, y: H - 2, 'text-anchor': 'end', class: 'tick', text: 'step' }));
    if (yLabel) root.append(svg('text', { x: 4, y: T + 8, class: 'tick', text: yLabel }));
    if (typeof marker === 'number') {
      const m = svg('line', { x1: X(marker), x2: X(marker), y1: T, y2: H - B, class: 'train-marker' });
      m.dataset.step = String(marker);
      root.append(m);
    }
    for (const s of series) {
      let run = [];
      const flush = () => { if (run.length) root.append(svg('polyline', { points: run.join(' '), fill: 'none', stroke: s.color, 'stroke-width': 1.6 })); run = []; };
      s.x.forEach((x, i) => {
        const y = s.y[i];
        if (typeof y !== 'number') { flush(); return; }
        run.push(`${X(x).toFixed(1)},${Y(y).toFixed(1)}`);
        if (s.dots) root.append(svg('circle', { cx: X(x), cy: Y(y), r: 2.6, fill: s.color }, svg('title', { text: `${s.name} at step ${x}: ${fmt(y)}` })));
      });
      flush();
    }
    box.append(root);
    const legend = el('div', { class: 'legend' });
    for (const s of series) {
      const item = el('span', { class: 'legend-item' }, [el('span', { class: 'swatch', style: { background: s.color } }), s.name]);
      Object.assign(item.dataset, { series: s.name, points: String(s.y.filter((y) => typeof y === 'number').length) });
      legend.append(item);
    }
    box.append(legend);
  }
  function markerStep() {
    const c = view.data.checkpoints.find((x) => x.name === current());
    return c ? c.step : null;
  }
  function drawCurves() {
    const c = view.data.curves, m = markerStep();
    chart($('train-loss'), 'loss (nats per token)', [
      { name: 'train', x: c.train.step, y: c.train.loss, color: '#2f6fd6' },
      { name: 'held-out', x: c.val.step, y: c.val.loss, color: '#d9480f', dots: true }], m);
    chart($('train-bpb'), 'bits per byte', [
      { name: 'train (at the held-out text\u2019s bytes per token)', x: c.train.step, y: c.train.bpb, color: '#2f6fd6' },
      { name: 'held-out', x: c.val.step, y: c.val.bpb, color: '#d9480f', dots: true }], m);
  }
  function groupOf(name) { const g = /^blocks\.(\d+)\./.exec(name); return g ? `blocks.${g[1]}` : 'outside the blocks'; }
  function drawStats() {
    const stats = view.data.stats, kinds = Object.keys(stats), box = $('train-stats');
    if (!kinds.length) {
      clear(box).append(el('p', { class: 'muted', text: 'This run logged no per-layer statistics (train --stats-every N writes them).' }));
      $('train-stat').disabled = true; $('train-stat-group').disabled = true;
      return;
    }
    if (!kinds.includes(view.kind)) view.kind = kinds[0];
    fill($('train-stat'), kinds, (k) => STAT_TITLES[k] || k, view.kind, (k) => { view.kind = k; view.group = 'all'; drawStats(); });
    const st = stats[view.kind], all = Object.keys(st.series);
    const groups = ['all', ...new Set(all.map(groupOf))];
    if (!groups.includes(view.group)) view.group = 'all';
    fill($('train-stat-group'), groups, (g) => g, view.group, (g) => { view.group = g; drawStats(); });
    const shown = all.filter((n) => view.group === 'all' || groupOf(n) === view.group);
    chart(box, STAT_TITLES[view.kind] || view.kind,
      shown.map((n, i) => ({ name: n, x: st.step, y: st.series[n], color: G.tokColor(i), dots: st.step.length < 30 })), markerStep());
  }
  // ------------------------------------------------------------------ a mixture's load per expert
  function drawMoe() {
    const moe = view.data.moe, sec = $('train-moe');
    sec.hidden = !moe;
    if (!moe) return;
    const m = markerStep();
    let at = moe.step.length - 1; // the latest logged step, or the last one at or before the checkpoint's
    if (typeof m === 'number') { const i = moe.step.findLastIndex((s) => s <= m); if (i >= 0) at = i; }
    const load = moe.load[at], E = load.length ? load[0].length : 0, box = clear($('train-moe-load'));
    box.append(el('div', { class: 'chart-title', text: `step ${moe.step[at]}: ${load.length} mixture layers \u00d7 ${E} experts (even: ${fmt(1 / E)})` }));
    const grid = el('div', { style: { display: 'grid', gap: '2px', gridTemplateColumns: `auto repeat(${E}, minmax(44px, auto))`, font: '12px var(--mono)' } });
    grid.append(el('div'));
    for (let e = 0; e < E; e++) grid.append(el('div', { class: 'hdr', text: `expert ${e}` }));
    const top = Math.max(...load.flat().filter((x) => typeof x === 'number'), 1e-9);
    load.forEach((layer, l) => {
      grid.append(el('div', { class: 'hdr', text: `mixture layer ${l}` }));
      layer.forEach((x, e) => {
        const share = typeof x === 'number' ? x : 0;
        const c = el('div', { class: 'moe-load', text: `${(100 * share).toFixed(1)}%`,
          title: `mixture layer ${l}, expert ${e}: ${fmt(share)} of the routed slots (even: ${fmt(1 / E)})`,
          style: { padding: '2px 6px', borderRadius: '3px', textAlign: 'right',
            background: `rgba(47, 111, 214, ${(0.06 + 0.8 * share / top).toFixed(3)})`, color: share / top > 0.6 ? '#fff' : '' } });
        Object.assign(c.dataset, { layer: String(l), expert: String(e), share: String(share) });
        grid.append(c);
      });
    });
    box.append(grid);
    const aux = $('train-moe-aux');
    if (moe.aux_loss.some((y) => typeof y === 'number')) {
      chart(aux, 'load-balancing loss (before the coefficient)', [{ name: 'aux loss', x: moe.step, y: moe.aux_loss, color: '#7048e8' }], m);
    } else {
      clear(aux).append(el('p', { class: 'muted', text: 'This run trained without a load-balancing loss (router_aux_loss_coef 0).' }));
    }
  }
  function fill(sel, values, label, value, onChange) {
    clear(sel);
    for (const v of values) sel.append(el('option', { value: v, text: label(v) }));
    sel.value = value;
    sel.disabled = false;
    sel.onchange = () => onChange(sel.value);
  }

  // ------------------------------------------------------------------ the logit lens
  function drawLens() {
    const box = clear($('train-lens')), lens = G.P().lens;
    if (!lens) { box.append(el('p', { class: 'muted', text: 'no logit lens in this answer' })); return; }
    const nT = lens.labels[0] ? lens.labels[0].length : 0;
    const grid = el('div', { class: 'lens', style: { gridTemplateColumns: `auto repeat(${nT}, minmax(64px, auto))` } });
    grid.append(el('div'));
    for (let t = 0; t < nT; t++) grid.append(el('div', { class: 'hdr' + (t === G.state.token ? ' sel' : ''), text: G.tokenLabel(t) }));
    lens.layers.forEach((layer, l) => {
      grid.append(el('div', { class: 'hdr', text: `block ${layer}` }));
      for (let t = 0; t < nT; t++) {
        const p = lens.probs[l][t], labels = lens.labels[l][t];
        const tip = labels.map((s, k) => `${s}  ${fmt(p[k])}`).join('\n');
        const c = el('div', { class: 'lens-cell' + (t === G.state.token ? ' sel' : ''), title: tip, text: labels[0],
          style: { background: `rgba(47, 111, 214, ${(0.08 + 0.8 * p[0]).toFixed(3)})`, color: p[0] > 0.55 ? '#fff' : '' } });
        Object.assign(c.dataset, { layer: String(layer), token: String(t), id: String(lens.ids[l][t][0]), prob: String(p[0]) });
        grid.append(c);
      }
    });
    box.append(grid);
  }

  // ------------------------------------------------------------------ one optimizer update
  function drawUpdate() {
    const params = view.data.params || {}, sel = $('train-param'), names_ = Object.keys(params);
    if (!sel.options.length && names_.length) {
      fill(sel, names_, (n) => `${n} (${params[n].join('×')})`, names_[0], () => { $('train-index').value = params[sel.value].map(() => 0).join(','); });
      $('train-index').value = params[names_[0]].map(() => 0).join(',');
    }
    const c = view.data.checkpoints.find((x) => x.name === current());
    $('train-update').disabled = !c;
    $('train-update-step').textContent = c ? `the update after ${c.name}: step ${c.step} \u2192 ${c.step + 1}, recomputed from the checkpoint and the run\u2019s data` : 'open one of the run\u2019s checkpoints first';
  }
  function askUpdate() {
    const c = view.data.checkpoints.find((x) => x.name === current());
    const index = $('train-index').value.split(',').map((s) => Number(s.trim()));
    if (!c) return;
    if (index.some((i) => !Number.isInteger(i))) { G.message('the element is its index, integers separated by commas (e.g. 0,3)'); return; }
    fetch('api/update', { method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ step: c.step, param: $('train-param').value, index }) })
      .then(async (res) => {
        const body = await res.json();
        if (!res.ok) { G.message(G.errorText(body, res.status)); return; }
        G.message('');
        G.showCalc(body, true);
      })
      .catch((e) => G.message(`could not reach the server: ${e}`));
  }

  // ------------------------------------------------------------------ drawing
  function draw() {
    const sec = $('view-training');
    if (!G.P().run && !view.data) { sec.hidden = true; return; }
    frame();
    sec.hidden = false;
    if (!view.data) { fetchRun(); return; }
    for (const part of [drawSlider, drawCurves, drawStats, drawMoe, drawLens, drawUpdate]) {
      try { part(); } catch (e) { console.error(e); G.message(`could not draw part of the training view: ${e}`); }
    }
    sec.dataset.checkpoint = current() || '';
    sec.dataset.drawn = String(++view.drawn);
  }
  G.view({ draw, onToken: () => { if (view.data) drawLens(); } });
})();
