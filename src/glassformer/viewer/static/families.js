// glassformer explorer: the parts the model families add (issue 45), from the page data's `families`
// entry (viewer/families.py): each token's route through the experts of every mixture layer (which
// experts, with what weight), the weight each head's sink took, the norms around the sublayers
// (sandwich, post-branch, Gemma's 1 + w, QK norms with gains), and which layers slide or skip RoPE.
// Every number is clickable: its calculation comes from explain, as everywhere on the page.
// As in glass.js, every text from the data reaches the page through textContent.
'use strict';
(function () {
  const G = window.Glass;
  const { el, clear, fmt, $ } = G;
  const view = { layer: null };

  function fam() { return G.P().families; }
  function probeData(name) { const p = G.TR().probes[name]; return p ? p.data : null; }
  function rmsOf(name, t) { const r = G.P().rms && G.P().rms[name]; return r ? r[t] : null; }

  function frame() {
    const sec = $('view-families');
    if (!sec) return null;
    if (!sec.dataset.built) {
      sec.dataset.built = '1';
      sec.append(
        el('h2', { text: 'Inside this family\u2019s own parts' }),
        el('p', { class: 'lede', text: 'What this model adds to the plain Transformer: the route each token takes through the experts, the weight the attention sink takes, the norms around each sublayer, and which layers slide or turn by another RoPE table. Click any number for its calculation.' }),
        el('div', { id: 'fam-layers', class: 'fam-layers' }),
        el('div', { id: 'fam-moe' }),
        el('div', { id: 'fam-sinks' }),
        el('div', { id: 'fam-norms' }));
    }
    return sec;
  }

  // ------------------------------------------------------------------ layer kinds
  function drawLayers(f) {
    const box = clear($('fam-layers'));
    const bits = [];
    if (f.scores) bits.push(`scores ${f.scores.query_pre_attn_scalar ? `× ${fmt(f.scores.query_pre_attn_scalar)}^−½` : '× 1/√H'}${f.scores.softcap ? `, soft-capped at ±${fmt(f.scores.softcap)}` : ''}`);
    if (f.embed_scale) bits.push('embeddings × √D');
    if (bits.length) box.append(el('p', { class: 'note', text: `This model: ${bits.join('; ')}.` }));
    if (!f.layers) return;
    const row = el('div', { class: 'fam-chips' });
    for (const k of f.layers) {
      const words = [k.window ? `sliding ${k.window}` : 'full', k.rope === null ? 'no RoPE' : k.rope === 'local' ? 'local RoPE' : 'RoPE'];
      if (k.moe) words.push('experts');
      row.append(el('span', { class: 'pill', title: `layer ${k.layer}`, text: `L${k.layer}: ${words.join(' · ')}` }));
    }
    box.append(row);
  }

  // ------------------------------------------------------------------ routes through the experts
  function drawMoe(f) {
    const box = clear($('fam-moe'));
    const m = f.moe;
    if (!m) return;
    const layers = m.layers.map((l) => l.layer);
    if (!layers.includes(view.layer)) view.layer = layers[0];
    const L = m.layers.find((l) => l.layer === view.layer);
    const sel = el('select', { id: 'fam-moe-layer', 'aria-label': 'mixture layer' });
    for (const i of layers) sel.append(el('option', { value: String(i), text: `layer ${i}` }));
    sel.value = String(view.layer);
    sel.onchange = () => { view.layer = Number(sel.value); drawMoe(f); };
    box.append(el('h3', { text: `Routes through the experts (${m.experts} experts, ${m.k} per token${m.shared_experts ? `, ${m.shared_experts} shared` : ''})` }),
      el('p', { class: 'note', text: `The router scores every expert for each token (${m.router}), keeps the top ${m.k}${m.renorm ? ' and rescales their weights to sum 1' : ' with their probabilities as weights'}; the feed-forward's output is the weighted sum of those experts' outputs${m.shared_experts ? ', plus the shared experts every token passes through' : ''}. A filled cell is a chosen expert and its weight; a pale one the router's probability of an expert not chosen.` }),
      el('div', { class: 'controls' }, [el('label', {}, ['layer ', sel])]));
    const t0 = G.state.token;
    const grid = el('table', { class: 'grid fam-routes' });
    const head = el('tr', {}, [el('th', { text: 'token' })]);
    for (let e = 0; e < m.experts; e++) head.append(el('th', { text: `e${e}` }));
    if (L.shared) head.append(el('th', { text: 'shared' }));
    grid.append(head);
    L.routes.forEach((route, t) => {
      const tr = el('tr', { class: t === t0 ? 'sel' : '' });
      tr.dataset.token = String(t);
      tr.append(el('td', { class: 'probe', text: G.tokenLabel(t) }));
      for (let e = 0; e < m.experts; e++) {
        const r = route.find((x) => x.expert === e);
        const td = el('td');
        if (r) {
          td.className = 'chosen';
          td.style.background = `rgba(47, 111, 214, ${(0.12 + 0.6 * Math.max(0, Math.min(1, r.weight))).toFixed(3)})`;
          td.dataset.expert = String(e);
          td.append(G.num(r.weight, `blocks.${L.layer}.ffn.expert_weights`, [t, r.slot]));
        } else if (L.probs) {
          td.append(el('span', { class: 'muted' }, G.num(L.probs[t][e], `blocks.${L.layer}.ffn.router_probs`, [t, e])));
        }
        tr.append(td);
      }
      if (L.shared) tr.append(el('td', { class: 'muted', text: 'always' }));
      grid.append(tr);
    });
    box.append(el('div', { class: 'scroll' }, grid));
    const slots = L.load.reduce((a, b) => a + b, 0) || 1;
    const bars = el('div', { class: 'summary-bars' });
    L.load.forEach((n, e) => bars.append(el('div', { class: 'bar-row' }, [el('span', { text: `e${e}` }),
      el('div', { class: 'bar' }, el('span', { style: { width: `${(100 * n / slots).toFixed(1)}%` } })), el('span', { text: `${n} of ${slots}` })])));
    box.append(el('p', { class: 'note', text: `Load in layer ${L.layer}: the routed slots each expert took in this sentence (even: ${fmt(slots / m.experts)} each).` }), bars);
    // The selected token's route through every mixture layer, in order.
    const path = el('p', { class: 'fam-path' }, [el('b', { text: `“${G.tokenLabel(t0)}”: ` })]);
    m.layers.forEach((l, n) => {
      if (n) path.append(' → ');
      path.append(`L${l.layer} `);
      l.routes[t0].forEach((r, j) => { if (j) path.append(' + '); path.append(`e${r.expert}·`, G.num(r.weight, `blocks.${l.layer}.ffn.expert_weights`, [t0, r.slot])); });
      if (l.shared) path.append(' + shared');
    });
    box.append(path);
  }

  // ------------------------------------------------------------------ sinks
  function drawSinks(f) {
    const box = clear($('fam-sinks'));
    if (!f.sinks) return;
    const t = G.state.token;
    box.append(el('h3', { text: 'Attention sinks: the weight each head\u2019s sink took' }),
      el('p', { class: 'note', text: `Each head has a learned logit that joins the softmax's denominator and adds no value: the keys' weights for “${G.tokenLabel(t)}” sum to 1 minus the sink's. A head that has nothing to read puts its weight on the sink.` }));
    const table = el('table', { class: 'grid' });
    table.append(el('tr', {}, [el('th', { text: 'layer' }), el('th', { text: 'sink weight per head' })]));
    for (const s of f.sinks) {
      const cell = el('td');
      s.weight[t].forEach((w, h) => {
        const head = s.heads[h];
        cell.append(el('span', { class: 'head-tag', text: `h${head}` }), G.num(w, `blocks.${s.layer}.attn.sink_weight`, [t, head]), ' ');
      });
      table.append(el('tr', {}, [el('td', { class: 'probe', text: `L${s.layer}${s.window ? ` (sliding ${s.window})` : ''}` }), cell]));
    }
    box.append(table);
  }

  // ------------------------------------------------------------------ norms around the sublayers
  function drawNorms(f) {
    const box = clear($('fam-norms'));
    const n = f.norms;
    if (!n) return;
    const t = G.state.token;
    const where = { sandwich: 'a norm before each sublayer and another on its output, before the addition (sandwich, Gemma 2/3)',
      post_branch: 'the sublayer reads the stream itself; a norm on its output, before the addition (OLMo 2)',
      pre: 'a norm before each sublayer (pre-norm)', post: 'a norm after each addition (post-norm)' }[n.placement];
    const words = [where];
    if (n.offset) words.push('each norm scales by 1 + w, the stored weight w starting at 0 (Gemma)');
    if (n.qk_norm === 'head') words.push('queries and keys are RMS-normalised per head with a gain of H weights, before RoPE');
    if (n.qk_norm === 'proj') words.push('queries and keys are RMS-normalised over the whole projection (N·H and K·H weights), before RoPE');
    box.append(el('h3', { text: 'Norms around the sublayers' }), el('p', { class: 'note', text: `${words.join('; ')}.` }));
    const table = el('table', { class: 'grid' });
    table.append(el('tr', {}, [el('th', { text: 'layer' }), el('th', { text: 'branch' }), el('th', { text: 'RMS before → after its norm' }), el('th', { text: 'what the addition adds' })]));
    n.adds.forEach((adds, i) => {
      for (const part of ['attn', 'ffn']) {
        const added = adds[part];
        const raw = part === 'attn' ? `blocks.${i}.attn.out` : `blocks.${i}.ffn.down`;
        const d = probeData(added);
        if (!added || !d || added === raw) continue;
        const a = rmsOf(raw, t), b = rmsOf(added, t);
        table.append(el('tr', {}, [el('td', { class: 'probe', text: `L${i}` }), el('td', { text: part === 'attn' ? 'attention' : 'feed-forward' }),
          el('td', { text: `${a === null ? '—' : fmt(a)} → ${b === null ? '—' : fmt(b)}` }),
          el('td', {}, G.vector(d[t], added, [t]))]));
      }
    });
    box.append(table);
    if (n.qk_norm !== 'head' && n.qk_norm !== 'proj') return;
    // The normalised queries and keys of the selected token, per layer (the numbers RoPE then turns).
    const qk = el('table', { class: 'grid' });
    qk.append(el('tr', {}, [el('th', { text: 'layer' }), el('th', { text: 'q_norm (first head)' }), el('th', { text: 'k_norm (first KV head)' })]));
    n.adds.forEach((_, i) => {
      const q = probeData(`blocks.${i}.attn.q_norm`), k = probeData(`blocks.${i}.attn.k_norm`);
      if (!q || !k) return;
      const qh = axisIds(`blocks.${i}.attn.q_norm`, 'head'), kh = axisIds(`blocks.${i}.attn.k_norm`, 'kv_head');
      qk.append(el('tr', {}, [el('td', { class: 'probe', text: `L${i}` }),
        el('td', {}, G.vector(q[t][0], `blocks.${i}.attn.q_norm`, [t, qh[0]])),
        el('td', {}, G.vector(k[t][0], `blocks.${i}.attn.k_norm`, [t, kh[0]]))]));
    });
    box.append(el('div', { class: 'scroll' }, qk));
  }
  function axisIds(name, axis) {
    const p = G.TR().probes[name], ix = p && p.index && p.index[axis];
    return ix || [0];
  }

  // ------------------------------------------------------------------ the sink in the attention maps
  // Under each head's map (glass.js draws it, then calls onAttention): the weight the sink took from
  // each query row, the share of the row that no key got.
  function onAttention() {
    const f = fam();
    if (!f || !f.sinks) return;
    const layer = G.state.layer;
    const s = f.sinks.find((x) => x.layer === layer);
    if (!s) return;
    document.querySelectorAll('#heatmaps .heatmap-card').forEach((card) => {
      const head = Number(card.dataset.head), h = s.heads.indexOf(head);
      if (h < 0) return;
      const row = el('div', { class: 'fam-sink-row' }, [el('span', { class: 'note', text: 'sink took, per query: ' })]);
      s.weight.forEach((w, t) => row.append(el('span', { class: 'head-tag', text: G.tokenLabel(t) }), G.num(w[h], `blocks.${layer}.attn.sink_weight`, [t, head]), ' '));
      card.append(row);
    });
  }

  function draw() {
    const sec = frame();
    if (!sec) return;
    const f = fam();
    sec.hidden = !f;
    if (!f) return;
    for (const [fn, name] of [[drawLayers, 'layers'], [drawMoe, 'routes'], [drawSinks, 'sinks'], [drawNorms, 'norms']]) {
      try { fn(f); } catch (e) { console.error(e); G.message(`could not draw the ${name} of the families view: ${e}`); }
    }
  }

  G.view({ draw, onToken: draw, onAttention });
})();
