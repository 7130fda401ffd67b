// glassformer explorer: the model map (#model-map), a flat SVG picture of the model drawn from the
// live config, never a fixed picture: the embedding table, each block ([data-block="i"]) with its
// query heads (coloured by the KV head they read) and its feed-forward (or its experts), the
// residual stream as the tokens' lanes, the final norm, the LM head and the softmax. The selected
// token's lane is lit and its numbers (the stream's RMS after every block, its most likely next
// token) are written along it; the flow along the lane moves unless the user asks for reduced
// motion (tour.css). Clicking a part selects its layer and scrolls to that part's numbers below,
// opening the first one's calculation in #explain; clicking a lane selects its token.
// Safety: as in glass.js, data reaches the page through text nodes only.
'use strict';
(function () {
  const G = window.Glass;
  const { el, svg, clear, fmt, fmtInt, tokColor, $, P, TR, CFG, tokenLabel, state } = G;
  const MAX_LANES = 16; // lanes drawn at most (the selected token's always)
  const MAX_HEADS = 32; // head boxes drawn per block at most
  const MAX_EXPERTS = 64;

  function reduced() { return window.matchMedia && window.matchMedia('(prefers-reduced-motion: reduce)').matches; }
  function layers() { return TR().layers || G.range(CFG().n_layers || 0); }
  function isMoe(cfg, i) {
    if (!(cfg.n_experts > 0)) return false;
    return !Array.isArray(cfg.moe_layers) || cfg.moe_layers.includes(i);
  }
  function probeData(name) { const p = TR().probes[name]; return p ? p.data : null; }
  function rms(name, t) { const r = P().rms || {}; return r[name] ? r[name][t] : null; }

  function section() {
    let sec = $('view-map');
    if (sec) return sec;
    sec = el('section', { id: 'view-map', class: 'view' }, [
      el('h2', {}, [el('span', { class: 'n', text: '◇' }), 'The model, as a picture']),
      el('p', { class: 'lede', text: 'Drawn from this model’s own configuration. Each token is a lane running left to right along the residual stream; every block reads the stream, and its attention (one box per query head, coloured by the key/value head it reads) and its feed-forward network add their results back. The selected token’s lane is lit, with the stream’s RMS after each block. Click any part to see its numbers below.' }),
      el('div', { class: 'map-wrap' }, el('div', { id: 'model-map', role: 'group', 'aria-label': 'model map' })),
    ]);
    $('views').prepend(sec);
    return sec;
  }

  // Scroll to a part's numbers below and open the first one's calculation.
  function go(target, layer) {
    if (layer !== undefined) G.selectLayer(layer);
    const node = typeof target === 'string' ? document.querySelector(target) : target;
    if (!node) return;
    node.scrollIntoView({ behavior: reduced() ? 'auto' : 'smooth', block: 'start' });
    const first = node.matches('.num') ? node : node.querySelector('.num');
    if (first) first.click();
  }
  function part(kind, props, children, onOpen) {
    const g = svg('g', Object.assign({ class: 'map-part', tabindex: '0', role: 'button' }, props), children);
    g.dataset.part = kind;
    g.addEventListener('click', (ev) => { ev.stopPropagation(); onOpen(); });
    g.addEventListener('keydown', (ev) => { if (ev.key === 'Enter' || ev.key === ' ') { ev.preventDefault(); onOpen(); } });
    return g;
  }
  function label(x, y, text, cls, anchor) {
    return svg('text', { x, y, 'text-anchor': anchor || 'middle', class: cls || '', text });
  }

  function draw() {
    section();
    const box = clear($('model-map'));
    const cfg = CFG(), ids = layers(), L = ids.length, T = TR().tokens.length, t = state.token;
    if (!L) { box.append(el('p', { class: 'muted', text: 'This trace holds no blocks to draw.' })); return; }
    const N = cfg.n_heads || 1, K = cfg.n_kv_heads || N, group = Math.max(1, N / K);
    // Lanes: every token when few, else the selected one and its neighbours.
    const lanes = T <= MAX_LANES ? G.range(T) : G.range(MAX_LANES).map((k) => Math.min(T - MAX_LANES, Math.max(0, t - MAX_LANES + 3)) + k);
    const headCols = Math.min(8, Math.min(N, MAX_HEADS)), headRows = Math.ceil(Math.min(N, MAX_HEADS) / headCols);
    const laneGap = lanes.length <= 8 ? 12 : 8, laneTop = 118 + 10 * Math.max(0, headRows - 2), laneH = laneGap * (lanes.length - 1);
    const ffnTop = laneTop + laneH + 26, ffnH = 46, H = ffnTop + ffnH + 30;
    const left = 86, embedW = 58, gap = 14, tailW = 3 * 62 + 2 * gap;
    const avail = Math.max(560, box.clientWidth || 960);
    // A deep model's blocks get narrow (down to 40 px: a 32-block model fits 1,900 px) with short labels,
    // so no label runs into the next block; below that the picture scrolls inside its box.
    const blockW = Math.max(40, Math.min(190, (avail - left - embedW - tailW - 4 * gap) / L));
    const roomy = blockW >= 130, tight = blockW < 66;
    const rmsEvery = Math.max(1, Math.ceil(58 / (blockW + gap))); // the RMS of every k-th block, so none overlap
    const W = left + embedW + gap + L * (blockW + gap) + tailW + 20;
    const root = svg('svg', { viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': `model map: ${L} blocks` });
    // Drawn at its size, never wider; on a narrow screen it keeps a readable size and scrolls inside
    // its own box (tour.css), never the page.
    root.style.width = `${W}px`;
    const laneY = (k) => laneTop + laneGap * k;
    const selK = lanes.indexOf(t);
    const lanesG = svg('g', { class: 'map-lanes' }), over = svg('g', { class: 'map-over' }); // drawn over the blocks

    // The lanes: the residual stream, one coloured line per token from the embedding to the head.
    const x0 = left + embedW, x1 = W - 20 - 2 * 62 - gap;
    lanes.forEach((tok, k) => {
      const line = svg('path', { d: `M ${x0} ${laneY(k)} H ${x1}`, class: 'map-lane' + (tok === t ? ' sel' : ''), stroke: tokColor(tok), 'stroke-width': tok === t ? 5 : 2 });
      line.dataset.token = String(tok);
      line.append(svg('title', { text: `token ${tok}: ${tokenLabel(tok)}` }));
      lanesG.append(line);
      lanesG.append(label(left - 6, laneY(k) + 3, tokenLabel(tok).slice(0, 10), 'map-small', 'end'));
      // A lane is thin: a band the lane's height, unseen, takes its clicks, which select its token.
      for (const [hx, hw] of [[left - 60, 60], [x0, x1 - x0]]) { // its label, and the lane past the embedding table
        const hit = svg('rect', { x: hx, y: laneY(k) - laneGap / 2, width: hw, height: laneGap, class: 'map-lane-hit' });
        hit.dataset.token = String(tok);
        hit.addEventListener('click', () => G.selectToken(tok));
        lanesG.append(hit);
      }
    });
    if (selK >= 0) lanesG.append(svg('path', { d: `M ${x0} ${laneY(selK)} H ${x1}`, class: 'map-flow' }));
    if (T > lanes.length) lanesG.append(label(left - 6, laneY(lanes.length - 1) + 16, `${lanes.length} of ${T} lanes`, 'map-small', 'end'));
    lanesG.append(label(left - 6, laneTop - 12, 'tokens', 'map-small', 'end'));

    // The embedding table.
    const embed = part('embed', {}, [svg('rect', { class: 'map-box', x: left, y: 40, width: embedW, height: H - 70, rx: 6 }),
      label(left + embedW / 2, 56, 'embedding'), label(left + embedW / 2, 70, `${fmtInt(cfg.vocab_size)} × ${cfg.dim}`, 'map-small'),
      svg('title', { text: `embedding table: one row of ${cfg.dim} numbers per id of the ${fmtInt(cfg.vocab_size)}` })],
    () => go('#numbers tr[data-probe="embed"]', ids[0]));
    root.append(embed);

    const x = left + embedW + gap;
    const stream = P().wiring || [];
    ids.forEach((i, n) => {
      const bx = x + n * (blockW + gap);
      const g = svg('g', { class: 'map-block' });
      g.dataset.block = String(i);
      g.append(svg('rect', { class: 'map-frame', x: bx, y: 22, width: blockW, height: H - 34, rx: 8 }));
      g.append(label(bx + blockW / 2, 35, tight ? String(i) : `block ${i}`, 'map-small'));
      // Attention: its heads, read from the stream above the lanes and added back at the first +.
      const ax = bx + 6, aw = blockW - 12, ay = 42, ah = laneTop - ay - 24;
      const attn = part('attn', {}, [svg('rect', { class: 'map-box', x: ax, y: ay, width: aw, height: ah, rx: 5 }),
        label(ax + aw / 2, ay + 12, (roomy ? 'attention' : tight ? 'A' : 'attn') + (cfg.attn_sinks && !tight ? ' + sinks' : ''), '')],
      () => go('#view-attention', i));
      const hw = Math.max(1.5, Math.min(14, (aw - 8) / headCols - 2)), shown = Math.min(N, MAX_HEADS);
      for (let h = 0; h < shown; h++) {
        const c = h % headCols, r = Math.floor(h / headCols);
        const kv = Math.floor(h / group);
        const rect = svg('rect', { class: 'map-head' + (K < N && kv % 2 ? ' kv1' : ''), x: ax + 4 + c * (hw + 2) + (aw - 8 - headCols * (hw + 2)) / 2, y: ay + 18 + r * (hw + 2), width: hw, height: hw, rx: 2 },
          svg('title', { text: `head ${h}, reads KV head ${kv}` }));
        rect.dataset.head = String(h);
        rect.addEventListener('click', (ev) => { ev.stopPropagation(); go(`#heatmaps .heatmap-card[data-head="${h}"]`, i); });
        attn.append(rect);
      }
      const sub = `${N} q / ${K} kv` + (N > MAX_HEADS ? ` (${MAX_HEADS} drawn)` : '');
      attn.append(label(ax + aw / 2, ay + ah - 6, tight ? `${N}/${K}` : sub, 'map-small'));
      g.append(attn);
      // Feed-forward (or the experts), below the lanes.
      const moe = isMoe(cfg, i);
      const fx = bx + 6, fw = blockW - 12;
      const ffn = part('ffn', {}, [svg('rect', { class: 'map-box', x: fx, y: ffnTop, width: fw, height: ffnH, rx: 5 })],
        () => go(`#numbers tr[data-probe="blocks.${i}.ffn.up"], #numbers tr[data-probe="blocks.${i}.ffn.down"]`, i));
      if (moe) {
        const E = cfg.n_experts, k = cfg.n_active_experts || 1, drawn = Math.min(E, MAX_EXPERTS);
        const per = Math.min(16, drawn), ew = Math.min(8, (fw - 8) / per - 1.5);
        const chosen = new Set(((probeData(`blocks.${i}.ffn.expert_ids`) || [])[t] || []).map(Number));
        for (let e = 0; e < drawn; e++) {
          const er = svg('rect', { class: 'map-expert' + (chosen.has(e) ? ' on' : ''), x: fx + 4 + (e % per) * (ew + 1.5), y: ffnTop + 16 + Math.floor(e / per) * (ew + 1.5), width: ew, height: ew, rx: 1 },
            svg('title', { text: `expert ${e}` + (chosen.has(e) ? `: chosen for ${tokenLabel(t)}` : '') }));
          er.dataset.expert = String(e);
          ffn.append(er);
        }
        ffn.append(label(fx + fw / 2, ffnTop + 11, roomy ? `${E} experts, top ${k}` + (cfg.n_shared_experts ? ` + ${cfg.n_shared_experts} shared` : '') : tight ? `${E}/${k}` : `${E} exp., top ${k}`, 'map-small'));
      } else {
        ffn.append(label(fx + fw / 2, ffnTop + 18, roomy ? `feed-forward (${cfg.ffn || 'ffn'})` : tight ? 'F' : (cfg.ffn || 'FFN')));
        if (!tight) ffn.append(label(fx + fw / 2, ffnTop + 33, `${cfg.dim} → ${cfg.ffn_dim} → ${cfg.dim}`, 'map-small'));
      }
      g.append(ffn);
      // Branches: attention leaves the stream and comes back at the first +, the FFN at the second.
      const top = laneY(0), bottom = laneY(lanes.length - 1);
      const a1 = bx + blockW * 0.3, a2 = bx + blockW * 0.55, f1 = bx + blockW * 0.62, f2 = bx + blockW * 0.86;
      g.append(svg('path', { class: 'map-branch', d: `M ${a1} ${top - 4} V ${ay + ah} M ${a2} ${ay + ah} V ${top - 4}` }));
      g.append(svg('path', { class: 'map-branch', d: `M ${f1} ${bottom + 4} V ${ffnTop} M ${f2} ${ffnTop} V ${bottom + 4}` }));
      for (const [ax2, yy] of [[a2, top - 10], [f2, bottom + 10]]) {
        g.append(svg('circle', { class: 'map-add', cx: ax2, cy: yy, r: 6 }));
        g.append(label(ax2, yy + 3.5, '+', 'map-small'));
      }
      // The selected token's number after this block: the stream's RMS where the block ends.
      const out = stream[i] && stream[i].out, r = out ? rms(out, t) : null;
      if (r !== null && r !== undefined && selK >= 0 && ((n + 1) % rmsEvery === 0 || n === L - 1)) {
        const txt = label(bx + blockW - 4, laneY(selK) - 5, roomy ? `RMS ${fmt(r)}` : fmt(r), 'map-rms', 'end');
        txt.style.animationDelay = reduced() ? '0s' : `${0.12 * (n + 1)}s`;
        over.append(txt);
      }
      root.append(g);
    });
    const tx0 = x + L * (blockW + gap);
    // The tail: final norm, the LM head, the softmax and the token it gives the selected one.
    const tail = [['final_norm', 'final norm', cfg.norm === 'layer' ? 'LayerNorm' : 'RMSNorm', () => go('#numbers tr[data-probe="final_norm"]', ids[L - 1])],
      ['lm_head', 'LM head', `${cfg.dim} → ${fmtInt(cfg.vocab_size)}`, () => go(`#next .next-card:nth-child(${t + 1})`)],
      ['softmax', 'softmax', 'next token', () => go('#view-sample')]];
    tail.forEach(([kind, name, sub, open], k) => {
      const tx = tx0 + k * (62 + gap);
      root.append(part(kind, {}, [svg('rect', { class: 'map-box', x: tx, y: laneTop - 24, width: 62, height: laneH + 48, rx: 6 }),
        label(tx + 31, laneTop - 10, name), label(tx + 31, laneTop + laneH + 18, sub, 'map-small')], open));
    });
    const next = (P().next || [])[t];
    if (next && next.length) {
      const top = next[0];
      const txt = label(tx0 + 2 * (62 + gap) + 31, laneTop + laneH + 40, `→ ${top.label} ${fmt(top.prob)}`, 'map-next map-rms');
      txt.style.animationDelay = reduced() ? '0s' : `${0.12 * (L + 2)}s`;
      over.append(txt);
    }
    const r0 = rms('embed', t);
    // The embedding's RMS sits inside its table, where no lane runs.
    if (r0 !== null && r0 !== undefined && selK >= 0) over.append(label(left + embedW / 2, laneY(selK) + 3, fmt(r0).length <= 4 ? `RMS ${fmt(r0)}` : fmt(r0), 'map-rms'));
    root.append(lanesG, over);
    box.append(root);
  }

  G.view({ draw, onToken: draw });
})();
