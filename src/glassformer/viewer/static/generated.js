// glassformer explorer, view 11: the generated text (the payload's `generated` part, written by
// viewer/generated.py). Each new token is coloured by the probability the model gave it; a click
// (or Enter) opens the step that chose it: its decode step (the KV cache and the one new row of
// scores, read from the trace of the whole text), the sampler's stages at that step and the top
// alternatives. The page computes nothing: every number comes with the data or from the server.
// Live pages get a Generate form beside the sentence (POST api/generate).
//
// Safety: as in glass.js, text from the data reaches the page through textContent only.
'use strict';
(function () {
  const G = window.Glass;
  const { el, clear, fmt, fmtInt, $, P, TR, CFG, tokenLabel, showCalc, calcNum, message, errorText } = G;
  const FEATURES = 8; // numbers shown per key/value vector, as the decode view (7) shows
  const SHOWN = 10; // bars per sampling stage
  // Probability bands of the colouring, most likely first: [lower bound, legend text].
  const BANDS = [[0.5, 'p ≥ 0.5'], [0.2, '0.2 – 0.5'], [0.05, '0.05 – 0.2'], [0.01, '0.01 – 0.05'], [0, 'p < 0.01']];
  const STAGE_TITLES = { logits: 'raw logits', repetition_penalty: 'repetition penalty', temperature: '÷ temperature',
    top_k: 'top-k cut', top_p: 'top-p cumulative cut', min_p: 'min-p threshold', probs: 'renormalised probabilities' };
  const view = { payload: null, selected: null, layer: 0, head: 0 };

  function band(p) { const i = BANDS.findIndex(([lo]) => p >= lo); return i < 0 ? BANDS.length - 1 : i; }
  function gen() { const g = P().generated; return g && Array.isArray(g.tokens) ? g : null; }

  // ------------------------------------------------------------------ the Generate form (live pages)
  function number(id, props) { return el('input', Object.assign({ id, type: 'number', step: '1', min: '0' }, props)); }
  function buildForm() {
    if ($('generate-form')) return $('generate-form');
    const form = el('form', { id: 'generate-form', class: 'generate', autocomplete: 'off' }, [
      el('label', {}, ['max tokens ', number('gen-max', { min: '1', max: '64', value: '20' })]),
      el('label', {}, ['temperature ', number('gen-temperature', { step: '0.1', max: '2', value: '1' })]),
      el('label', {}, ['top-k ', number('gen-top-k', { value: '0', title: '0: off' })]),
      el('label', {}, ['top-p ', number('gen-top-p', { step: '0.05', min: '0.05', max: '1', value: '1', title: '1: off' })]),
      el('label', {}, ['seed ', number('gen-seed', { value: '0' })]),
      el('button', { id: 'generate', type: 'submit', text: 'Generate' }),
    ]);
    form.addEventListener('submit', (ev) => { ev.preventDefault(); ask(); });
    $('sentence-form').after(form);
    return form;
  }
  // The new tokens asked for fit the context: at most the room the sentence leaves (the toy model's
  // context of 16 holds 12 after its 4 tokens), and the default 20 comes down to it until the user types one.
  function fitMax() {
    const input = $('gen-max'), room = (CFG().max_seq_len || 64) - TR().tokens.length;
    const most = Math.max(1, Math.min(64, room));
    input.max = String(most);
    if (!input.dataset.typed) input.value = String(Math.min(20, most));
    input.oninput = () => { input.dataset.typed = '1'; };
    $('generate').disabled = room < 1;
    $('generate').title = room < 1 ? `the sentence fills the model's context of ${CFG().max_seq_len} tokens` : '';
  }
  function request() {
    const v = (id) => Number($(id).value);
    const k = Math.floor(v('gen-top-k')) || 0, p = v('gen-top-p');
    return { text: $('sentence').value, max_tokens: Math.floor(v('gen-max')), temperature: v('gen-temperature'),
      top_k: k > 0 ? k : null, top_p: p > 0 && p < 1 ? p : null, seed: Math.floor(v('gen-seed')) || 0,
      checkpoint: P().checkpoint }; // view --run: the checkpoint the page shows
  }
  async function ask() {
    if (P().mode !== 'server') return;
    $('busy').hidden = false; $('generate').disabled = true;
    try {
      const res = await fetch('api/generate', { method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify(request()) });
      const body = await res.json();
      if (!res.ok) { message(errorText(body, res.status)); return; }
      message('');
      G.setPayload(body); // every view redraws on the whole text; this one from body.generated
      $('view-generated').scrollIntoView({ block: 'start' });
    } catch (e) {
      message(`could not reach the server: ${e}`);
    } finally { $('busy').hidden = true; $('generate').disabled = false; }
  }

  // ------------------------------------------------------------------ the text
  function legend() {
    const box = el('div', { class: 'gen-legend' }, [el('span', { class: 'muted', text: 'the probability the model gave each new token: ' })]);
    BANDS.forEach(([, text], i) => box.append(el('span', { class: `gen-tok gen-p${i} gen-key`, text })));
    return box;
  }
  function breaksAfter(piece) { return typeof piece === 'string' && piece.endsWith('\n'); }
  function textBox(g) {
    const box = el('div', { class: 'gen-text', role: 'group', 'aria-label': 'generated text' });
    for (let i = 0; i < g.prompt_tokens; i++) {
      box.append(el('span', { class: 'gen-prompt', text: tokenLabel(i), title: `prompt token ${i}` }));
      if (breaksAfter(TR().tokens[i])) box.append(el('br'));
    }
    g.tokens.forEach((t, j) => {
      const b = el('button', { class: `gen-tok gen-p${band(t.prob)}` + (j === view.selected ? ' sel' : ''), type: 'button', text: t.label,
        title: `p = ${t.prob} (rank ${t.rank}), id ${t.id}, position ${t.position}: click for the step that chose it`,
        'aria-pressed': String(j === view.selected) });
      Object.assign(b.dataset, { index: String(j), id: String(t.id), prob: String(t.prob), position: String(t.position) });
      b.addEventListener('click', () => select(j));
      b.addEventListener('keydown', (ev) => moveKey(ev, j, g.tokens.length));
      box.append(b);
      if (breaksAfter(t.piece)) box.append(el('br'));
    });
    return box;
  }
  function moveKey(ev, j, n) { // arrows walk the tokens; Enter and Space are the button's own click
    const step = ev.key === 'ArrowRight' ? 1 : ev.key === 'ArrowLeft' ? -1 : 0;
    if (!step || j + step < 0 || j + step >= n) return;
    ev.preventDefault();
    select(j + step);
  }
  function select(j) {
    view.selected = j;
    draw();
    const b = document.querySelector(`#view-generated .gen-tok[data-index="${j}"]`);
    if (b) b.focus();
  }
  function settingsLine(g) {
    const s = g.settings || {};
    const flags = [`--max-new-tokens ${g.max_tokens}`, `--temperature ${s.temperature}`];
    if (s.top_k !== null && s.top_k !== undefined) flags.push(`--top-k ${s.top_k}`);
    if (s.top_p !== null && s.top_p !== undefined) flags.push(`--top-p ${s.top_p}`);
    if (s.min_p !== null && s.min_p !== undefined) flags.push(`--min-p ${s.min_p}`);
    if (s.repetition_penalty !== null && s.repetition_penalty !== undefined && s.repetition_penalty !== 1) flags.push(`--repetition-penalty ${s.repetition_penalty}`);
    if (s.seed !== null && s.seed !== undefined) flags.push(`--seed ${s.seed}`);
    const text = `${g.tokens.length} new ${g.tokens.length === 1 ? 'token' : 'tokens'} after a prompt of ${g.prompt_tokens}, ` +
      `drawn by glassformer.generate: the same tokens as glassformer generate ${flags.join(' ')}.`;
    const out = [el('p', { class: 'note', text })];
    if (!g.roundtrip && P().mode === 'server') {
      out.push(el('p', { class: 'note', text: 'This text does not encode back to the same tokens, so the other views, which re-read the text, may show a different split; the view below holds its own numbers.' }));
    }
    return out;
  }

  // ------------------------------------------------------------------ one step: alternatives
  function alternatives(t) {
    const box = el('div', { class: 'gen-part gen-top' }, [el('h3', { text: 'Top alternatives' })]);
    const top = t.top.slice();
    if (!top.some((c) => c.id === t.id)) top.push(t);
    const best = top[0] ? top[0].prob : 1;
    top.forEach((c, r) => {
      const own = c.id === t.id && r >= t.top.length; // the token itself, below the top ones
      const row = el('div', { class: 'cand gen-alt' + (c.id === t.id ? ' chosen' : '') }, [
        el('span', { class: 'piece', text: own ? `${c.label} (rank ${t.rank})` : c.label, title: `id ${c.id}` }),
        el('div', { class: 'bar' }, el('span', { style: { width: `${(100 * c.prob / best).toFixed(1)}%` } })),
        calcNum(fmt(c.prob), c.calc, { prob: String(c.prob), id: String(c.id) }),
        el('span', { class: 'val', text: `logit ${fmt(c.logit)}` })]);
      row.dataset.id = String(c.id);
      box.append(row);
    });
    return box;
  }

  // ------------------------------------------------------------------ one step: the sampler
  function stageBar(st, j, s, best) {
    const id = st.ids[j], prob = st.probs[j], val = st.values[j], top = best || st.probs[0] || 1;
    const label = (s.labels || {})[String(id)] || `#${id}`;
    const row = el('div', { class: 'cand sample-bar' + (st.name === 'probs' && id === s.chosen ? ' chosen' : ''),
      title: `id ${id}\n${st.kind === 'logits' ? 'logit' : 'probability'} ${val}\nprobability ${prob}` }, [
      el('span', { class: 'piece', text: label }),
      el('div', { class: 'bar' }, el('span', { style: { width: `${(100 * prob / top).toFixed(1)}%` } })),
      el('span', { class: 'val', text: fmt(val) })]);
    Object.assign(row.dataset, { id: String(id), prob: String(prob) });
    const calc = st.name === 'probs' && s.calc ? s.calc[String(id)] : null;
    if (calc) {
      Object.assign(row, { tabIndex: 0 });
      row.setAttribute('role', 'button');
      row.classList.add('clickable');
      row.addEventListener('click', () => showCalc(calc, true));
      row.addEventListener('keydown', (ev) => { if (ev.key === 'Enter' || ev.key === ' ') { ev.preventDefault(); showCalc(calc, true); } });
    }
    return row;
  }
  function sampling(t, g) {
    const s = t.sampling;
    const box = el('div', { class: 'gen-part gen-sampling' }, [el('h3', { text: 'The sampler at this step' })]);
    if (!s) { box.append(el('p', { class: 'muted', text: 'No sampling stages in this page.' })); return box; }
    const grid = el('div', { class: 'stages' });
    for (const st of s.stages) {
      const card = el('div', { class: 'stage-card' });
      card.dataset.stage = st.name;
      card.append(el('h3', { text: STAGE_TITLES[st.name] || st.name }));
      const rest = st.rest > 0 ? `; the others' probability ${fmt(st.rest)}` : '';
      card.append(el('p', { class: 'note', text: `${fmtInt(st.kept)} ${st.kept === 1 ? 'id' : 'ids'} kept${rest}` }));
      for (let j = 0; j < Math.min(SHOWN, st.ids.length); j++) card.append(stageBar(st, j, s));
      if (st.name === 'probs' && s.sampled > 0 && !st.ids.slice(0, SHOWN).includes(s.chosen)) { // the drawn id, further down
        card.append(el('p', { class: 'note', text: '… and the one drawn:' }));
        card.append(stageBar({ name: st.name, kind: st.kind, ids: [s.chosen], probs: [s.sampled], values: [s.sampled] }, 0, s, st.probs[0]));
      }
      grid.append(card);
    }
    box.append(grid);
    const seed = (g.settings || {}).seed, run = seed === null || seed === undefined ? 'the run (unseeded)' : `the run seeded ${seed}`;
    box.append(el('p', { class: 'ok', text: `generate drew “${t.label}” (id ${t.id}) here with probability ${fmt(s.sampled)}: ` +
      `step ${t.position - g.prompt_tokens + 1} of ${run} (each draw moves the generator on, so this is not the first draw a fresh seed gives).` }));
    return box;
  }

  // ------------------------------------------------------------------ one step: the decode step
  function probe(name) { const p = TR().probes[name]; return p ? p.data : null; }
  function ids(name, axis, n) { // the model's ids of a probe's stored entries (a trace may keep some heads)
    const p = TR().probes[name], ix = p && p.index && p.index[axis];
    return ix && !Array.isArray(ix[0]) ? ix : G.range(n);
  }
  function explainNum(value, name, index) {
    const key = `${name}|${index.join(',')}`;
    const b = el('button', { class: 'num', type: 'button', text: fmt(value), title: `${name}[${index.join(', ')}] = ${value}` });
    Object.assign(b.dataset, { probe: name, index: JSON.stringify(index) });
    b.addEventListener('click', (ev) => { ev.stopPropagation(); explainOf(name, index, key); });
    return b;
  }
  async function explainOf(name, index, key) {
    const p = P(), stored = p.explain && p.explain[key], title = `${name}[${index.join(', ')}]`;
    if (stored) { showCalc(stored, true); return; }
    if (p.mode !== 'server' || !gen().roundtrip) {
      showCalc({ title, text: p.mode === 'server' ? 'This text does not encode back to its tokens, so the server cannot recompute this number from it.'
        : 'This saved page stores the calculations of the numbers it shows first; open the model with `glassformer view` to compute this one.' }, true);
      return;
    }
    try {
      const res = await fetch('api/explain', { method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ text: p.sentence, probe: name, index, checkpoint: p.checkpoint }) });
      const body = await res.json();
      if (!res.ok) { showCalc({ title, text: errorText(body, res.status) }, true); return; }
      p.explain = p.explain || {};
      p.explain[key] = body;
      showCalc(body, true);
    } catch (e) { showCalc({ title, text: `could not reach the server: ${e}` }, true); }
  }
  function vec(values, name, prefix) {
    const box = el('span', { class: 'vec' });
    values.slice(0, FEATURES).forEach((x, f) => box.append(explainNum(x, name, prefix.concat([f]))));
    if (values.length > FEATURES) box.append(el('span', { class: 'more', text: `… +${values.length - FEATURES} more` }));
    return box;
  }
  function choose(label, options, value, onChange) {
    const sel = el('select', { 'aria-label': label });
    for (const i of options) sel.append(el('option', { value: String(i), text: String(i) }));
    const v = options.includes(value) ? value : options[0];
    sel.value = String(v);
    sel.addEventListener('change', () => onChange(Number(sel.value)));
    return [el('label', {}, [`${label} `, sel]), v];
  }
  function decodeStep(t) {
    const box = el('div', { class: 'gen-part gen-decode' }, [el('h3', { text: 'Its decode step: the KV cache and the one new row of scores' })]);
    const layers = TR().layers || G.range(CFG().n_layers || 0);
    const [layerPick, layer] = choose('layer', layers, view.layer, (v) => { view.layer = v; draw(); });
    const [headPick, head] = choose('head', ids(`blocks.${layer}.attn.weights`, 'head', CFG().n_heads), view.head, (v) => { view.head = v; draw(); });
    view.layer = layer; view.head = head;
    box.append(el('div', { class: 'controls' }, [layerPick, headPick]));
    const pre = `blocks.${layer}.attn.`;
    const kName = TR().probes[pre + 'k_rot'] ? pre + 'k_rot' : pre + 'k', vName = pre + 'v', sName = pre + 'scores', wName = pre + 'weights';
    const qName = TR().probes[pre + 'q_rot'] ? pre + 'q_rot' : pre + 'q';
    const K = probe(kName), V = probe(vName), S = probe(sName), W = probe(wName), Q = probe(qName);
    if (!K || !V || !S || !W) { box.append(el('p', { class: 'muted', text: 'This trace holds no keys, values and scores for this layer.' })); return box; }
    const q = t.query, kvh = Math.floor(head / (CFG().n_heads / CFG().n_kv_heads));
    const hp = ids(wName, 'head', CFG().n_heads).indexOf(head), qp = ids(qName, 'head', CFG().n_heads).indexOf(head);
    const kp = ids(kName, 'kv_head', CFG().n_kv_heads).indexOf(kvh), vp = ids(vName, 'kv_head', CFG().n_kv_heads).indexOf(kvh);
    box.append(el('p', { class: 'note', text: `“${t.label}” (position ${t.position}) was chosen from the logits at position ${q}, “${tokenLabel(q)}”: ` +
      `that step wrote its own key and value into the cache beside the ${q} before it and computed one new row of scores. Query head ${head} reads KV head ${kvh}.` }));
    const cache = el('table', { class: 'grid gen-cache' });
    cache.append(el('tr', {}, ['pos', 'token', `key (${kName.split('.').pop()})`, 'value'].map((h) => el('th', { text: h }))));
    for (let j = 0; j <= q; j++) {
      cache.append(el('tr', { class: j === q ? 'hl' : '' }, [el('td', { text: String(j) }), el('td', { text: tokenLabel(j) + (j === q ? '  ← this step' : '') }),
        el('td', {}, vec(K[j][kp], kName, [j, kvh])), el('td', {}, vec(V[j][vp], vName, [j, kvh]))]));
    }
    const row = el('table', { class: 'grid gen-row' });
    row.append(el('tr', {}, ['key', 'scaled score', 'weight'].map((h) => el('th', { text: h }))));
    for (let j = 0; j <= q; j++) {
      const w = W[q][hp][j];
      const tr = el('tr', {}, [el('td', { text: tokenLabel(j) }), el('td', {}, explainNum(S[q][hp][j], sName, [q, head, j])),
        el('td', {}, w === null ? el('span', { class: 'muted', text: 'masked' }) : explainNum(w, wName, [q, head, j]))]);
      tr.dataset.key = String(j);
      row.append(tr);
    }
    const right = el('div', {}, [el('h3', { class: 'muted', text: `The new row (query position ${q})` })]);
    if (Q && qp >= 0) right.append(el('p', {}, ['query ', vec(Q[q][qp], qName, [q, head])]));
    right.append(row);
    box.append(el('div', { class: 'split' }, [el('div', {}, [el('h3', { class: 'muted', text: `KV cache, layer ${layer}, KV head ${kvh}` }), cache]), right]));
    return box;
  }

  // ------------------------------------------------------------------ the view
  function detail(g, j) {
    const t = g.tokens[j];
    const box = el('div', { id: 'gen-detail', class: 'gen-detail' });
    Object.assign(box.dataset, { index: String(j), position: String(t.position), query: String(t.query) });
    box.append(el('h3', {}, [`“${t.label}” (id ${t.id}, position ${t.position}): the model gave it p = `,
      calcNum(fmt(t.prob), t.calc, { prob: String(t.prob) }), ` (rank ${t.rank}; log-probability ${fmt(t.logprob)})`]));
    box.append(el('div', { class: 'gen-parts' }, [alternatives(t), sampling(t, g)]), decodeStep(t));
    return box;
  }
  function draw() {
    const sec = $('view-generated'), g = gen(), live = P().mode === 'server';
    const form = live ? buildForm() : $('generate-form');
    if (form) form.hidden = !live;
    if (live) fitMax();
    if (view.payload !== P()) { view.payload = P(); view.selected = null; }
    clear(sec);
    if (!g) { sec.hidden = true; return; }
    sec.hidden = false;
    sec.append(el('h2', {}, [el('span', { class: 'n', text: '11' }), 'Generated text']),
      el('p', { class: 'lede', text: 'The text generate wrote after the prompt, each new token coloured by the probability the model gave it (the softmax of its logits, before temperature and the filters). Click a token, or press Enter on it, for the step that chose it: its top alternatives, the sampler’s stages and its decode step. ← and → move along the tokens.' }));
    sec.append(...settingsLine(g), legend(), textBox(g));
    if (view.selected !== null && view.selected < g.tokens.length) sec.append(detail(g, view.selected));
    else sec.append(el('p', { class: 'muted', id: 'gen-detail-hint', text: 'Click a generated token to open its step.' }));
  }
  function onToken() { // a token chip chosen elsewhere on the page: open that token's step if it is a new one
    const g = gen();
    if (!g) return;
    const j = G.state.token - g.prompt_tokens;
    if (j >= 0 && j < g.tokens.length && j !== view.selected) { view.selected = j; draw(); }
  }
  G.view({ draw, onToken });
})();
