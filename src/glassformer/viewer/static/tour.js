// glassformer explorer: the guided walk (#view-tour). The walkthroughs' steps in their order, one
// step a screen ([data-tour-step="n"], n from 1): why the step exists, in a paragraph, then the live
// model's numbers for the selected token (button.num opens its calculation in #explain; a number the
// page derives here, such as an unscaled score, is a plain .fig). ◀ / ▶, the ← / → keys and the
// step menu move through it; the step's number is kept in the address (#step=n; ?step=n works too)
// so a link opens that step. The RoPE step draws each token's first pair turning by its angle; the
// prefill/decode step draws the grid of attention weights with the new row lit.
// Safety: as in glass.js, data reaches the page through text nodes only.
'use strict';
(function () {
  const G = window.Glass;
  const { el, svg, clear, fmt, fmtInt, fmtBytes, $, P, TR, CFG, tokenLabel, state } = G;
  const SHOWN_TOKENS = 10; // rows of per-token tables (the selected token's neighbourhood)

  // ------------------------------------------------------------------ data helpers
  function probe(name) { const p = TR().probes[name]; return p ? p.data : null; }
  function layer() { const ids = TR().layers || G.range(CFG().n_layers || 0); return ids.includes(state.layer) ? state.layer : ids[0]; }
  function ids(name, axis, n) { const p = TR().probes[name], ix = p && p.index && p.index[axis]; return ix && !Array.isArray(ix[0]) ? ix : G.range(n); }
  function headPos(name, head) { return ids(name, 'head', CFG().n_heads).indexOf(head); }
  function kvOf(head) { return Math.floor(head / (CFG().n_heads / CFG().n_kv_heads)); }
  function kvPos(name, head) { return ids(name, 'kv_head', CFG().n_kv_heads).indexOf(kvOf(head)); }
  function firstHead() { return ids(`blocks.${layer()}.attn.weights`, 'head', CFG().n_heads)[0] || 0; }
  function tokens() {
    const T = TR().tokens.length, t = state.token;
    if (T <= SHOWN_TOKENS) return G.range(T);
    const start = Math.max(0, Math.min(T - SHOWN_TOKENS, t - SHOWN_TOKENS + 3));
    return G.range(SHOWN_TOKENS).map((k) => start + k);
  }
  function dot(a, b) { let s = 0; for (let i = 0; i < a.length; i++) s += a[i] * b[i]; return s; }
  // A head's vector of a (token, head, feature) probe, or null.
  function headVec(name, t, head, kv) {
    const d = probe(name); if (!d) return null;
    const p = kv ? kvPos(name, head) : headPos(name, head);
    return p >= 0 && d[t] ? d[t][p] : null;
  }

  // ------------------------------------------------------------------ drawing helpers
  function fig(x, cls) { return el('span', { class: 'fig' + (cls ? ' ' + cls : ''), text: typeof x === 'number' ? fmt(x) : String(x) }); }
  function figInt(n) { return el('span', { class: 'fig', text: fmtInt(n) }); }
  function figs(v) { return el('span', { class: 'vec' }, v.map((x) => fig(x))); }
  function nums(v, name, prefix) { return G.vector(v, name, prefix); }
  function row(labelText, ...parts) { return el('div', { class: 'tour-row' }, [el('span', { class: 'label', text: labelText }), ...parts]); }
  function table(head, rows) {
    const tb = el('table', { class: 'grid tour-grid' });
    tb.append(el('tr', {}, head.map((h) => el('th', { text: h }))));
    for (const r of rows) tb.append(r instanceof Node ? r : el('tr', {}, r.map((c) => el('td', {}, c))));
    return el('div', { class: 'tour-scroll' }, tb);
  }
  function see(text, target) {
    const a = el('a', { href: `#${target}`, text });
    a.addEventListener('click', (ev) => { ev.preventDefault(); const n = $(target); if (n) n.scrollIntoView({ block: 'start' }); });
    return el('p', { class: 'see' }, ['Every number of this step in full: ', a, '.']);
  }
  function missing(text) { return el('p', { class: 'muted', text }); }
  function tok(t) { return `“${tokenLabel(t)}”`; }

  // ------------------------------------------------------------------ the steps
  // [title, map part lit while it is shown, why, body()]
  const STEPS = [
    ['Words to vectors', 'embed',
      'A model cannot read letters. The tokenizer cuts the text into tokens and gives each an id; the id picks one row of the embedding table, a vector of D numbers. From here on, each token is that vector, a lane of numbers that runs left to right through the model.',
      stepEmbed],
    ['Queries, keys and values', 'attn',
      'Attention lets each token gather information from the tokens before it. Each token’s normalised vector is multiplied by three learned matrices: the query says what the token is looking for, the key what it offers to be found by, the value what it hands over when it is.',
      stepQKV],
    ['RoPE: turning by position', 'attn',
      'Attention itself does not know where a token sits. Rotary position embedding turns each (query, key) pair of numbers by an angle that grows with the position (faster for the first pairs, slower for later ones). Values are not turned. A query and a key at the same position turn alike, so their dot product is unchanged; in general it depends only on how far apart they are.',
      stepRope],
    ['Scores', 'attn',
      'How much should this token read each other one? The score is the dot product of its (turned) query with each (turned) key: large when they point the same way.',
      stepScores],
    ['Scale and mask', 'attn',
      'Dot products grow with the head size H, which would make the softmax too sharp, so scores are divided by √H. A token must not read the future, so the scores of later keys are masked out before the softmax (they become −∞).',
      stepMask],
    ['Softmax', 'attn',
      'The softmax turns a row of scores into weights that are positive and sum to 1: exp(score − max) divided by the row’s sum. A masked key gets exactly 0.',
      stepSoftmax],
    ['The weighted sum', 'attn',
      'The head’s output for a token is the sum of the values, each times its weight. The heads’ outputs are then laid side by side and mixed back to the model’s width by the output matrix W_O.',
      stepWeighted],
    ['Heads, and GQA / MQA', 'attn',
      'Several heads look for different things at once, each with its own queries. Keys and values take memory for every token kept in the cache, so grouped-query attention lets a group of query heads share one key/value head (multi-query attention: one for all).',
      stepHeads],
    ['The residual addition', 'stream',
      'Attention does not replace the token’s vector: its output is added to it. The stream keeps what it had and gains what attention found, and gradients flow straight through the addition when training.',
      stepResidual],
    ['RMSNorm', 'ffn',
      'Before each sublayer reads the stream, a copy is rescaled to RMS 1 (divided by √(mean x² + ε)) and multiplied by a learned weight γ, so the sublayer sees numbers of a steady size however large the stream has grown.',
      stepNorm],
    ['The feed-forward network', 'ffn',
      'Each token on its own now goes through two (or three) matrices: up to a wider space, a nonlinearity that switches parts off, and back down. This is where most of the weights are, and it is added to the stream as attention was.',
      stepFFN],
    ['Pre-norm and post-norm', 'stream',
      'Where the norm sits changes what the stream does. Pre-norm normalises only the copies the sublayers read, so the stream itself grows block after block; post-norm normalises the stream after every addition, holding it at RMS 1.',
      stepPrePost],
    ['The stream through the blocks', 'stream',
      'A block is attention then the feed-forward, each added to the stream. The model is the same block repeated with its own weights; the stream carries each token’s vector from one to the next.',
      stepStream],
    ['Prefill and decode', 'attn',
      'Generating reads the prompt once (prefill: every row of scores at once), then adds one token at a time (decode). A new token only adds one new row of scores, against the keys and values kept in the cache: no earlier row changes, because no token reads the future.',
      stepDecode],
    ['FlashAttention’s tiles', 'attn',
      'The whole grid of scores does not need to exist at once. The tiled kernel walks the keys a tile at a time, keeping a running max m, a running sum l and a running output o, rescaling them by α = exp(m_old − m_new) when the max rises; tiles that are fully masked are skipped. The result is the same.',
      stepFlash],
    ['The head and the next token', 'head',
      'After the last block, a final norm, then the LM head: one dot product of the token’s vector with each row of a V × D matrix gives a logit per id; the softmax turns the logits into the probability of each possible next token.',
      stepHead],
    ['What it costs', 'head',
      'Every weight is read for every token, so a forward pass costs about 2 FLOPs per weight per token; the KV cache holds two vectors per layer and KV head for every token of the context, which is what GQA saves.',
      stepCosts],
  ];

  function stepEmbed() {
    const c = CFG(), E = probe('embed'), out = [];
    out.push(row('vocabulary', figInt(c.vocab_size), ' ids; each row D = ', fig(c.dim), ' numbers wide'));
    if (P().vocab && P().vocab.length) {
      const known = P().vocab, inSent = new Set(TR().ids || []);
      out.push(row('this model’s words (id)', ...known.map((w, i) => el('span', {}, [` ${w} `, fig(i)]))));
      const unused = known.map((w, i) => i).filter((i) => !inSent.has(i));
      if (unused.length) out.push(row('ids not in this sentence', ...unused.map((i) => fig(i))));
    }
    if (TR().ids) out.push(row('the sentence’s ids', figs(TR().ids)));
    if (!E) return out.concat(missing('This trace holds no embeddings.'));
    const rms = (P().rms || {}).embed || [];
    out.push(table(['pos', 'token', 'id', 'embedding row', 'RMS'], tokens().map((t) => [
      fig(TR().positions ? TR().positions[t] : t), tokenLabel(t), TR().ids ? fig(TR().ids[t]) : '', nums(E[t], 'embed', [t]), rms[t] === undefined ? '' : fig(rms[t])])));
    if (c.pos === 'learned') out.push(el('p', { class: 'note', text: 'This model adds a learned position vector to each row here; a RoPE model adds none (the position is put in by turning q and k).' }));
    return out.concat(see('section 3, layer 0', 'view-numbers'));
  }

  function stepQKV() {
    const l = layer(), h = firstHead(), c = CFG(), out = [];
    out.push(row('sizes', 'D = ', fig(c.dim), ', head size H = ', fig(c.head_dim), ', ', fig(c.n_heads), ' query heads, ', fig(c.n_kv_heads), ' key/value heads'));
    const wq = ((P().tour || {}).weights || {}).W_Q;
    if (wq && l === (TR().layers || [0])[0]) {
      for (const [j, col] of Object.entries(wq.columns)) out.push(row(`W_Q column ${j} (block ${l}, head 0)`, figs(col)));
      out.push(el('p', { class: 'note', text: 'q[j] is the normalised vector times column j of W_Q: click a q below for the sum.' }));
    }
    const [qn, kn, vn] = ['q', 'k', 'v'].map((x) => `blocks.${l}.attn.${x}`);
    if (!probe(qn)) return out.concat(missing('This trace holds no queries for this layer.'));
    out.push(table(['token', `q (head ${h})`, `k (KV head ${kvOf(h)})`, 'v'], tokens().map((t) => [
      tokenLabel(t), nums(headVec(qn, t, h), qn, [t, h]),
      probe(kn) ? nums(headVec(kn, t, h, true), kn, [t, kvOf(h)]) : '', probe(vn) ? nums(headVec(vn, t, h, true), vn, [t, kvOf(h)]) : ''])));
    return out.concat(see(`section 3, block ${l}`, 'view-numbers'));
  }

  // RoPE: pair i is (i, i + H/2) ('half') or (2i, 2i+1) ('interleaved'); it turns by position · θ_i.
  function pairOf(i) { const H = CFG().head_dim; return CFG().rope_pairs === 'interleaved' ? [2 * i, 2 * i + 1] : [i, i + H / 2]; }
  function arrowFigure(before, after, t, kind) {
    const S = 84, c = S / 2, R = S / 2 - 8;
    const len = Math.max(Math.hypot(...before), Math.hypot(...after), 1e-9);
    const end = (v) => [c + R * v[0] / len, c - R * v[1] / len];
    const a0 = Math.atan2(before[1], before[0]), a1 = Math.atan2(after[1], after[0]);
    let turn = a1 - a0; while (turn > Math.PI) turn -= 2 * Math.PI; while (turn <= -Math.PI) turn += 2 * Math.PI;
    // Pair 0 turns by the position in radians (θ₀ = 1); a scaled RoPE's turn is read from the numbers.
    const angle = CFG().rope_scaling ? turn : (TR().positions ? TR().positions[t] : t);
    const root = svg('svg', { width: S, height: S, viewBox: `0 0 ${S} ${S}`, role: 'img', 'aria-label': `${kind} of ${tokenLabel(t)} turned by ${fmt(angle)} rad` });
    root.append(svg('circle', { cx: c, cy: c, r: R, fill: 'none', stroke: '#eef0f3' }));
    const [bx, by] = end(before), [ax, ay] = end(after);
    root.append(svg('line', { x1: c, y1: c, x2: bx, y2: by, class: 'arrow-before', 'stroke-width': 2 }));
    const g = svg('g', { class: 'arrow-turn' });
    g.style.transformOrigin = `${c}px ${c}px`;
    g.style.setProperty('--from', `${(turn * 180 / Math.PI).toFixed(1)}deg`);
    g.append(svg('line', { x1: c, y1: c, x2: ax, y2: ay, class: 'arrow-after', 'stroke-width': 2.5 }));
    g.append(svg('circle', { cx: ax, cy: ay, r: 3, fill: 'var(--accent)' }));
    root.append(g);
    return el('figure', {}, [root, el('figcaption', {}, [`${kind} ${tokenLabel(t)}: `, fig(angle), ' rad'])]);
  }
  function stepRope() {
    const l = layer(), h = firstHead(), c = CFG(), out = [];
    const qn = `blocks.${l}.attn.q`, kn = `blocks.${l}.attn.k`, qr = `blocks.${l}.attn.q_rot`, kr = `blocks.${l}.attn.k_rot`;
    if (!probe(qr) || !probe(kr)) return [missing(c.pos === 'rope' ? 'This trace holds no turned queries and keys for this layer (a layer without RoPE).' : 'This model has no RoPE: its positions are learned vectors added to the embeddings.')];
    const [i0, i1] = pairOf(0);
    out.push(el('p', { class: 'note', text: `The first pair (features ${i0} and ${i1}) of each token’s key, before (dashed) and after (solid): it turns by the token’s position × θ₀ = 1 radian per position${c.rope_scaling ? ' (this model scales its angles: the turn shown is measured from the numbers)' : ''}; pair i turns by θᵢ = ${fmt(c.rope_theta)}^(−2i/H).` }));
    const arrows = el('div', { class: 'tour-arrows' });
    for (const t of tokens().slice(0, 8)) {
      const k = headVec(kn, t, h, true), kk = headVec(kr, t, h, true);
      if (k && kk) arrows.append(arrowFigure([k[i0], k[i1]], [kk[i0], kk[i1]], t, 'k'));
    }
    out.push(arrows);
    out.push(table(['token', 'q', 'q turned', 'k', 'k turned'], tokens().map((t) => [tokenLabel(t),
      nums(headVec(qn, t, h), qn, [t, h]), nums(headVec(qr, t, h), qr, [t, h]),
      nums(headVec(kn, t, h, true), kn, [t, kvOf(h)]), nums(headVec(kr, t, h, true), kr, [t, kvOf(h)])])));
    const t = state.token, q = headVec(qn, t, h), k = headVec(kn, t, h, true), q2 = headVec(qr, t, h), k2 = headVec(kr, t, h, true);
    if (q && k && q2 && k2) {
      out.push(row(`${tok(t)} with itself: q·k before turning`, fig(dot(q, k)), ', after ', fig(dot(q2, k2)), ' (the same position turns both alike)'));
    }
    return out.concat(see(`section 3, block ${l}`, 'view-numbers'));
  }

  function scoreGrid(l, h, cell, rowsShown) {
    const S = probe(`blocks.${l}.attn.scores`), t = state.token, hp = headPos(`blocks.${l}.attn.scores`, h);
    const ts = rowsShown || tokens();
    const rows = ts.map((i) => {
      const tr = el('tr', { class: i === t ? 'hl' : '' }, [el('td', { text: tokenLabel(i) })]);
      for (const j of ts) tr.append(el('td', {}, cell(i, j, S[i][hp][j])));
      return tr;
    });
    return table(['query \\ key'].concat(ts.map(tokenLabel)), rows);
  }
  function sqrtScale() { const c = CFG(); return c.query_pre_attn_scalar ? Math.sqrt(c.query_pre_attn_scalar) : Math.sqrt(c.head_dim); }
  function stepScores() {
    const l = layer(), h = firstHead(), out = [];
    if (!probe(`blocks.${l}.attn.scores`)) return [missing('This trace holds no scores for this layer.')];
    out.push(el('p', { class: 'note', text: `Head ${h}, block ${l}: q·k for every query (row) and key (column), before scaling: the traced scaled score × √${CFG().query_pre_attn_scalar ? 'query_pre_attn_scalar' : 'H'} = ${fmt(sqrtScale())}${CFG().attn_softcap ? ' (this model soft-caps its scores, so this is approximate)' : ''}.` }));
    out.push(scoreGrid(l, h, (i, j, s) => fig(s * sqrtScale(), j > i ? 'future' : '')));
    return out.concat(see('section 2', 'view-attention'));
  }
  function stepMask() {
    const l = layer(), h = firstHead(), out = [], sName = `blocks.${l}.attn.scores`, wName = `blocks.${l}.attn.weights`;
    if (!probe(sName)) return [missing('This trace holds no scores for this layer.')];
    const W = probe(wName), wp = headPos(wName, h);
    out.push(el('p', { class: 'note', text: `Divided by √H = ${fmt(sqrtScale())}. Struck-through scores are masked (a later key${CFG().sliding_window ? ', or one outside the sliding window' : ''}).` }));
    out.push(scoreGrid(l, h, (i, j, s) => {
      const b = G.num(s, sName, [i, h, j]);
      if (W && W[i][wp][j] === null) b.classList.add('masked');
      return b;
    }));
    return out.concat(see('section 2', 'view-attention'));
  }
  function stepSoftmax() {
    const l = layer(), h = firstHead(), wName = `blocks.${l}.attn.weights`, W = probe(wName), wp = headPos(wName, h);
    if (!W) return [missing('This trace holds no attention weights for this layer.')];
    const out = [el('p', { class: 'note', text: 'Each row sums to 1; a masked key gets 0. Click a weight for its softmax.' })];
    out.push(scoreGrid(l, h, (i, j) => (W[i][wp][j] === null ? fig(0, 'masked') : G.num(W[i][wp][j], wName, [i, h, j]))));
    return out.concat(see('section 2', 'view-attention'));
  }
  function stepWeighted() {
    const l = layer(), h = firstHead(), t = state.token, out = [];
    const wName = `blocks.${l}.attn.weights`, vName = `blocks.${l}.attn.v`, zName = `blocks.${l}.attn.z`, oName = `blocks.${l}.attn.out`;
    const W = probe(wName), z = headVec(zName, t, h);
    if (!W || !z) return [missing('This trace holds no weighted sums for this layer.')];
    const wp = headPos(wName, h);
    const terms = el('div', { class: 'tour-row' }, [el('span', { class: 'label', text: `z[${tokenLabel(t)}] =` })]);
    tokens().filter((j) => j <= t).forEach((j, k) => {
      const w = W[t][wp][j];
      if (w === null) return;
      if (k) terms.append(' + ');
      terms.append(G.num(w, wName, [t, h, j]), ' · ', nums(headVec(vName, j, h, true), vName, [j, kvOf(h)]));
    });
    out.push(terms);
    out.push(row(`z[${tokenLabel(t)}], head ${h}`, nums(z, zName, [t, h])));
    if (probe(oName)) out.push(row('after W_O (all heads mixed)', nums(probe(oName)[t], oName, [t])));
    return out.concat(see(`section 3, block ${l}`, 'view-numbers'));
  }
  function stepHeads() {
    const l = layer(), c = CFG(), t = state.token, out = [], wName = `blocks.${l}.attn.weights`, W = probe(wName);
    out.push(row('this model', fig(c.n_heads), ' query heads read ', fig(c.n_kv_heads), ' key/value heads',
      c.n_kv_heads === c.n_heads ? ' (multi-head attention)' : c.n_kv_heads === 1 ? ' (multi-query attention)' : ` (grouped-query attention: groups of ${c.n_heads / c.n_kv_heads})`));
    if (W) {
      const hs = ids(wName, 'head', c.n_heads).slice(0, 8), keys = tokens().filter((j) => j <= t);
      out.push(table([`head (weights of ${tok(t)})`].concat(keys.map(tokenLabel)), hs.map((h, hp) =>
        [`${h} (KV ${kvOf(h)})`].concat(keys.map((j) => (W[t][hp][j] === null ? fig(0, 'masked') : G.num(W[t][hp][j], wName, [t, h, j])))))));
    }
    const per = (k) => 2 * c.n_layers * k * c.head_dim;
    out.push(row('KV-cache numbers per token (2 · layers · KV heads · H): as MHA', fig(per(c.n_heads)), `, as this model (${c.n_kv_heads} KV)`, fig(per(c.n_kv_heads)), ', as MQA', fig(per(1))));
    if (P().heads) { // a live page's head switch (heads.js): the same model with its KV heads averaged
      const a = el('a', { href: '#heads-switch', text: 'the head switch above the attention maps' });
      a.addEventListener('click', (ev) => { ev.preventDefault(); const n = $('heads-switch'); if (n) n.scrollIntoView({ block: 'center' }); });
      out.push(el('p', { class: 'see' }, ['This page can show the model as MHA, GQA or MQA without a restart (key/value heads averaged, nothing retrained): ', a, '; the walk then follows it.']));
    }
    const mh = (P().tour || {}).multi_head;
    if (mh) {
      out.push(el('h4', { text: `The walkthrough’s four-head variants, on “${mh.sentence}” (glassformer view --worked --variant mha | gqa | mqa)` }));
      out.push(row('heads', fig(mh.n_heads)));
      out.push(row('MHA, head 0’s weights of “cats” over I, like, cats', figs(mh.mha_head0_weights_cats_over_I_like_cats)));
      out.push(row('MHA, head 1’s', figs(mh.mha_head1_weights_cats_over_I_like_cats)));
      out.push(row('head 1’s own key of “I”', figs(mh.head1_key_I), '; GQA’s shared key of heads 0 and 1 (their W_K averaged)', figs(mh.gqa_shared_key_I)));
      out.push(row('GQA, head 0’s weights of “cats”', figs(mh.gqa_head0_weights_cats), '; head 1’s', figs(mh.gqa_head1_weights_cats)));
      out.push(row('GQA, head 0’s output for “cats”', figs(mh.gqa_head0_output_cats)));
      const kv = mh.kv_cache_numbers_per_token;
      out.push(row('KV-cache numbers per token: MHA', fig(kv.MHA), ', GQA', fig(kv.GQA), ', MQA', fig(kv.MQA)));
    }
    return out.concat(see('section 2', 'view-attention'));
  }
  function streamPoints() { // [label, probe] of the stream after each addition
    const pts = [['embedding', 'embed']];
    for (const i of TR().layers || G.range(CFG().n_layers)) {
      const w = (P().wiring || [])[i]; if (!w) continue;
      pts.push([`block ${i} + attention`, w.mid]);
      if (w.out !== w.mid) pts.push([`block ${i} + feed-forward`, w.out]);
    }
    return pts.filter(([, n]) => probe(n));
  }
  function stepResidual() {
    const l = layer(), t = state.token, w = (P().wiring || [])[l], out = [];
    const before = l === (TR().layers || [0])[0] ? 'embed' : (P().wiring[l - 1] || {}).out, oName = `blocks.${l}.attn.out`;
    if (!w || !probe(before) || !probe(oName) || !probe(w.mid)) return [missing('This trace holds no stream for this layer.')];
    const rms = P().rms || {};
    out.push(row(`stream of ${tok(t)} before block ${l}`, nums(probe(before)[t], before, [t]), ' RMS ', fig(rms[before][t])));
    out.push(row('+ attention’s output', nums(probe(oName)[t], oName, [t])));
    out.push(row('= the stream after the addition', nums(probe(w.mid)[t], w.mid, [t]), ' RMS ', fig(rms[w.mid][t])));
    if (CFG().norm_placement === 'post') out.push(el('p', { class: 'note', text: 'Post-norm: this model normalises the stream right after the addition.' }));
    return out.concat(see('section 1', 'view-lanes'));
  }
  function stepNorm() {
    const l = layer(), t = state.token, c = CFG(), w = (P().wiring || [])[l], out = [], nName = `blocks.${l}.ffn_norm`;
    if (!probe(nName) || !w || !probe(w.mid)) return [missing('This trace holds no feed-forward norm for this layer.')];
    const x = probe(w.mid)[t], r = (P().rms || {})[w.mid];
    out.push(row(`x: the stream of ${tok(t)}`, nums(x, w.mid, [t]), ' RMS ', r ? fig(r[t]) : ''));
    out.push(row('ε', fig(c.norm_eps), c.norm === 'layer' ? ' (LayerNorm: the mean is taken off first)' : ''));
    out.push(row('x / √(mean x² + ε) · γ', nums(probe(nName)[t], nName, [t])));
    return out.concat(see(`section 3, block ${l}`, 'view-numbers'));
  }
  function stepFFN() {
    const l = layer(), t = state.token, c = CFG(), out = [], pre = `blocks.${l}.ffn.`;
    const F = c.expert_dim && c.n_experts ? c.expert_dim : c.ffn_dim;
    out.push(row('W_up', fig(c.dim), ' × ', fig(F), '; W_down', fig(F), ' × ', fig(c.dim), c.ffn && c.ffn !== 'relu' && c.ffn !== 'gelu' ? `; ${c.ffn}: a gate matrix too` : ''));
    const wu = ((P().tour || {}).weights || {}).W_up;
    if (wu && l === (TR().layers || [0])[0]) for (const [j, col] of Object.entries(wu.columns)) out.push(row(`W_up column ${j}`, figs(col)));
    const parts = [['up', 'up'], ['gate', 'gate'], ['act', 'after the activation'], ['down', 'down (back to D)']];
    for (const [leaf, what] of parts) {
      const d = probe(pre + leaf);
      if (d) out.push(row(what, nums(d[t], pre + leaf, [t])));
      if (leaf === 'act' && d) {
        const shown = d[t], zeros = shown.filter((v) => v === 0).length, cut = TR().probes[pre + leaf].cut;
        out.push(row('exactly 0 after the activation', fig(zeros), ` of ${cut ? 'the first ' : ''}`, fig(shown.length)));
      }
    }
    if (probe(pre + 'router_probs')) {
      const ids2 = (probe(pre + 'expert_ids') || [])[t] || [], ws = (probe(pre + 'expert_weights') || [])[t] || [];
      out.push(row('router: the chosen experts', ...ids2.map((e, k) => el('span', {}, [' expert ', fig(e), ' weight ', fig(ws[k])]))));
    }
    const w = (P().wiring || [])[l];
    if (w && probe(w.out)) out.push(row('the block’s output: the stream + down', nums(probe(w.out)[t], w.out, [t])));
    return out.concat(see(`section 3, block ${l}`, 'view-numbers'));
  }
  function stepPrePost() {
    const nm = P().norm, out = [];
    if (!nm) return [missing('This page holds no pre-norm/post-norm comparison.')];
    const t = Math.min(state.token, nm.tokens.length - 1);
    out.push(el('p', { class: 'note', text: `The RMS of ${tok(t)}’s stream after each addition, the same weights with the norms in either place${nm.about ? ' (' + nm.about + ')' : ''}.` }));
    const kinds = Object.keys(nm.rms);
    out.push(table([''].concat(nm.steps), kinds.map((k) => [`${k}-norm`].concat(nm.rms[k][t].map((v, i) => {
      const calc = nm.calc && nm.calc[k] && nm.calc[k][t] ? nm.calc[k][t][i] : null;
      return calc ? G.calcNum(fmt(v), calc, { rms: k, token: String(t), step: String(i) }) : fig(v);
    })))));
    return out.concat(see('section 5', 'view-norm'));
  }
  function stepStream() {
    const t = state.token, rms = P().rms || {}, out = [];
    out.push(el('p', { class: 'note', text: `The RMS of ${tok(t)}’s stream after every addition, block after block (the map above draws the same stream as the token’s lane).` }));
    const pts = streamPoints();
    out.push(table(['where', 'RMS'], pts.map(([lab, n]) => [lab, rms[n] ? fig(rms[n][t]) : ''])));
    const last = pts[pts.length - 1];
    if (last) out.push(row('the stream leaving the last block', nums(probe(last[1])[t], last[1], [t])));
    return out.concat(see('section 1', 'view-lanes'));
  }
  let decodeMode = 'decode';
  function stepDecode() {
    const l = layer(), h = firstHead(), T = TR().tokens.length, last = T - 1, c = CFG(), out = [];
    const wName = `blocks.${l}.attn.weights`, vName = `blocks.${l}.attn.v`, W = probe(wName);
    if (!W) return [missing('This trace holds no attention weights for this layer.')];
    const wp = headPos(wName, h);
    const bar = el('div', { class: 'tour-row' });
    for (const mode of ['prefill', 'decode']) {
      const b = el('button', { type: 'button', class: mode === decodeMode ? 'tour-start' : '', text: mode === 'prefill' ? 'prefill: every row at once' : `decode: the new row of ${tokenLabel(last)}` });
      b.dataset.mode = mode;
      b.addEventListener('click', () => { decodeMode = mode; render(); });
      bar.append(b);
    }
    out.push(bar);
    const ts = G.range(T).slice(-SHOWN_TOKENS);
    const rows = ts.map((i) => {
      const cls = decodeMode === 'decode' ? (i === last ? 'new' : 'cached') : '';
      const tr = el('tr', { class: cls }, [el('td', { text: tokenLabel(i) + (decodeMode === 'decode' && i === last ? ' ← new' : '') })]);
      for (const j of ts) tr.append(el('td', {}, W[i][wp][j] === null ? fig(0, 'masked') : G.num(W[i][wp][j], wName, [i, h, j])));
      return tr;
    });
    rows[rows.length - 1].dataset.newRow = '1';
    out.push(table([`weights, head ${h} (query \\ key)`].concat(ts.map(tokenLabel)), rows));
    const v = headVec(vName, last, h, true);
    out.push(row(`decoding ${tok(last)} at position`, fig(TR().positions ? TR().positions[last] : last), v ? ': its value joins the cache ' : '', v ? nums(v, vName, [last, kvOf(h)]) : ''));
    if (last > 0) {
      const p = last - 1;
      out.push(row(`${tok(p)}’s weight on itself, unchanged by the new token`, G.num(W[p][wp][p], wName, [p, h, p])));
    }
    out.push(row('the cache grows by', fig(2 * c.n_layers * c.n_kv_heads * c.head_dim), ' numbers per token'));
    return out.concat(see('section 7', 'view-decode'));
  }
  function stepFlash() {
    const l = layer(), h = firstHead(), t = state.token, out = [], fl = P().flash || {};
    const tiles = fl.tiles && fl.tiles.length ? fl.tiles : [];
    const tile = [P().flash_tile, ...tiles].find((x) => x && fl.walks && fl.walks[`${l}|${h}|${t}|${x}`]);
    const walk = tile ? fl.walks[`${l}|${h}|${t}|${tile}`] : null;
    if (!walk) return [missing(`This page holds no tiled walk of ${tok(t)}’s row yet: section 6 runs it.`), see('section 6', 'view-flash')];
    out.push(el('p', { class: 'note', text: `Row ${tok(t)}, head ${h}, tiles of ${tile} keys.` }));
    const rows = walk.steps.map((st) => {
      const keys = G.range(st.k[1] - st.k[0]).map((q) => tokenLabel(st.k[0] + q)).join(' ');
      if (st.skipped) return [keys, el('span', { class: 'muted', text: 'fully masked: skipped' }), '', '', '', ''];
      const masked = st.scores.map((s, q) => (s === null ? tokenLabel(st.k[0] + q) : null)).filter((x) => x !== null);
      return [keys + (masked.length ? ` (masked: ${masked.join(', ')})` : ''), el('span', {}, st.scores.map((s) => (s === null ? fig('·') : fig(s)))),
        fig(st.m), st === walk.steps[0] ? '—' : fig(st.alpha), fig(st.l), figs(st.o)];
    });
    out.push(table(['key tile', 'scaled scores', 'm', 'α', 'l', 'o'], rows));
    out.push(row('result o / l', figs(walk.output)));
    const skipped = walk.steps.filter((s) => s.skipped).length;
    out.push(row('tiles skipped on this row', fig(skipped), skipped ? '' : ' (the fully masked tiles lie on earlier rows: section 6 shows the whole grid)'));
    return out.concat(see('section 6', 'view-flash'));
  }
  function stepHead() {
    const t = state.token, out = [], c = CFG();
    if (probe('final_norm')) out.push(row(`the final norm of ${tok(t)}`, nums(probe('final_norm')[t], 'final_norm', [t])));
    out.push(row('LM head', fig(c.vocab_size), ' × ', fig(c.dim), c.tie_embeddings ? ' (the embedding table itself: tied)' : ''));
    const nx = (P().next || [])[t];
    if (nx) out.push(table(['next token', 'probability', 'logit'], nx.map((cand) => [cand.label, G.num(cand.prob, 'probs', [t, cand.id]), G.num(cand.logit, 'logits', [t, cand.id])])));
    return out.concat(see('section 9, where the sampler picks one', 'view-sample'));
  }
  function stepCosts() {
    const out = [], rows = (P().costs || {}).rows || [];
    const pick = ['params', 'flops_per_token', 'kv_cache_bytes_per_token', 'kv_cache_bytes'];
    const shown = rows.filter((r) => pick.includes(r.key));
    if (shown.length) {
      out.push(table(['this model', 'value'], shown.map((r) => [r.key, r.calc ? G.calcNum(typeof r.value === 'number' ? fmtInt(r.value) : String(r.value), r.calc, { cost: r.key }) : fig(r.value)])));
    }
    const ref = (P().tour || {}).kv_reference;
    if (ref) {
      out.push(el('h4', { text: `Beside a large model: ${ref.name}’s KV cache in bf16` }));
      out.push(row('layers', fig(ref.layers), ', query heads', fig(ref.query_heads), ', KV heads', fig(ref.kv_heads), ', head size', fig(ref.head_dim), ', bytes a number', fig(ref.bytes_per_number)));
      out.push(row('bytes per token: 2 · layers · KV heads · H · bytes =', figInt(ref.bytes_per_token)));
      out.push(row(`a full context of`, figInt(ref.tokens), ' tokens: ', figInt(ref.gqa_total_bytes), ` bytes (${fmtBytes(ref.gqa_total_bytes)}) with GQA; as MHA `, figInt(ref.mha_total_bytes), ` (${fmtBytes(ref.mha_total_bytes)})`));
    }
    return out.concat(see('section 8', 'view-costs'));
  }

  // ------------------------------------------------------------------ the walk
  const walk = { open: false, step: 1 };
  function section() {
    let sec = $('view-tour');
    if (sec) return sec;
    sec = el('section', { id: 'view-tour', class: 'view' });
    const map = $('view-map');
    if (map) map.after(sec); else $('views').prepend(sec);
    return sec;
  }
  function stepFromAddress() {
    const m = /(?:^|[#&?])step=(\d+)/.exec(location.hash) || /(?:^|[?&])step=(\d+)/.exec(location.search);
    return m ? Math.max(1, Math.min(STEPS.length, Number(m[1]))) : null;
  }
  let remembering = null;
  function remember() { // once the walk rests: the address bar's update costs more than the step itself
    clearTimeout(remembering);
    remembering = setTimeout(writeAddress, 120);
  }
  function writeAddress() {
    const url = `${location.pathname}${location.search.replace(/([?&])step=\d+&?/, '$1').replace(/[?&]$/, '')}`;
    try { history.replaceState(null, '', walk.open ? `${url}#step=${walk.step}` : url); } catch (e) { /* a file:// page may refuse */ }
  }
  function go(n) {
    walk.open = true;
    walk.step = Math.max(1, Math.min(STEPS.length, n));
    show();
    remember();
  }
  function close() { walk.open = false; delete document.body.dataset.tourPart; render(); remember(); }
  function show() {
    const sec = section();
    if (!sec.querySelector('[data-tour-step]')) { render(); return; }
    const r = sec.getBoundingClientRect(); // read before the step changes: no layout forced here
    sec.querySelectorAll('[data-tour-step]').forEach((s) => { s.hidden = Number(s.dataset.tourStep) !== walk.step; });
    sec.querySelector('.tour-stage').scrollTop = 0;
    $('tour-title').textContent = `Step ${walk.step} of ${STEPS.length}: ${STEPS[walk.step - 1][0]}`;
    $('tour-menu').value = String(walk.step);
    $('tour-prev').disabled = walk.step === 1;
    $('tour-next').disabled = walk.step === STEPS.length;
    document.body.dataset.tourPart = STEPS[walk.step - 1][1];
    sec.dataset.step = String(walk.step);
    if (r.top < 0 || r.top > window.innerHeight * 0.6) sec.scrollIntoView({ block: 'start' });
  }
  function render() {
    const sec = clear(section());
    sec.append(el('h2', {}, [el('span', { class: 'n', text: '▶' }), 'Walk through the model, step by step']));
    if (!walk.open) {
      sec.append(el('p', { class: 'lede', text: `The two walkthroughs’ ${STEPS.length} steps, from words to vectors to the next token and what it costs, one step a screen, on this model’s own numbers for the selected token. ← and → move between steps; the address names the step, so a link opens it.` }));
      const start = el('button', { id: 'tour-start', type: 'button', class: 'tour-start', text: 'Start the walk ▶' });
      start.addEventListener('click', () => go(walk.step));
      sec.append(start);
      return;
    }
    const menu = el('select', { id: 'tour-menu', class: 'tour-menu', 'aria-label': 'step' }, STEPS.map(([title], i) => el('option', { value: String(i + 1), text: `${i + 1}. ${title}` })));
    menu.addEventListener('change', () => go(Number(menu.value)));
    const prev = el('button', { id: 'tour-prev', type: 'button', text: '◀ back' }), next = el('button', { id: 'tour-next', type: 'button', text: 'next ▶' });
    prev.addEventListener('click', () => go(walk.step - 1));
    next.addEventListener('click', () => go(walk.step + 1));
    const done = el('button', { id: 'tour-close', type: 'button', text: 'close the walk' });
    done.addEventListener('click', close);
    sec.append(el('div', { class: 'tour-bar' }, [prev, el('span', { id: 'tour-title', class: 'tour-title' }), next, menu, done]));
    // One screen whose size never depends on the step shown (tour.css: contain: strict), so that a
    // step lays out its own numbers only, never the long page below.
    const stage = el('div', { class: 'tour-stage' });
    sec.append(stage);
    STEPS.forEach(([title, , why, body], i) => {
      const box = el('div', { class: 'tour-step' });
      box.dataset.tourStep = String(i + 1);
      box.append(el('h3', { text: `${i + 1}. ${title}` }), el('p', { class: 'why', text: why }));
      try { for (const part of body()) box.append(part); } catch (e) { console.error(e); box.append(missing(`This step could not be drawn for this model: ${e}`)); }
      stage.append(box);
    });
    show();
  }
  function keys(ev) {
    if (!walk.open || ev.defaultPrevented || ev.altKey || ev.ctrlKey || ev.metaKey) return;
    if (ev.key !== 'ArrowLeft' && ev.key !== 'ArrowRight') return;
    const tgt = ev.target;
    if (tgt && tgt.closest && tgt.closest('input, select, textarea, [contenteditable], [role="slider"], .gen-tok')) return;
    ev.preventDefault();
    go(walk.step + (ev.key === 'ArrowRight' ? 1 : -1));
  }
  document.addEventListener('keydown', keys);
  window.addEventListener('hashchange', () => { const n = stepFromAddress(); if (n && (!walk.open || n !== walk.step)) go(n); });
  let first = true;
  function draw() {
    if (first) { first = false; const n = stepFromAddress(); if (n) { walk.open = true; walk.step = n; } }
    render();
  }
  G.view({ draw, onToken: render });
})();
