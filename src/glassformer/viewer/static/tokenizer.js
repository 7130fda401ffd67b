// glassformer explorer, section 10: the tokenizer view. The sentence → its UTF-8 bytes → the
// pre-tokenizer's chunks → each BPE merge in rank order → the ids, drawn from the payload's
// `tokenizer` (viewer/source.py tokenizer_view, from text/bpe_steps.py: the same steps
// `glassformer tokenize --steps` prints). Every piece is the server's label of it
// (text.labels.token_label: ␣ a space, ↵ a newline); the page computes none of it.
// Safety: as in glass.js, data reaches the page through text nodes only.
'use strict';
(function () {
  const G = window.Glass;
  const { el, clear, $, P } = G;
  const LEDE = 'How the sentence became the ids the model reads. Its text is UTF-8 bytes; the pre-tokenizer ' +
    'cuts it into chunks (a word with the space before it, a run of digits, punctuation); within each chunk ' +
    'the byte-level BPE starts from single bytes and applies the learned merges, always the one of lowest ' +
    'rank first, until no neighbouring pair is a merge; each piece left is one id. Added (special) tokens ' +
    'are matched whole first. A space is drawn ␣, a newline ↵.';

  function hex(b) { return b.toString(16).toUpperCase().padStart(2, '0'); }
  function chips(labels, cls) { return el('span', { class: 'tz-pieces' }, labels.map((s) => el('span', { class: `tz-piece ${cls || ''}`, text: s }))); }
  function stage(label, body) { return el('div', { class: 'tz-stage' }, [el('div', { class: 'tz-label', text: label }), el('div', { class: 'tz-body' }, body)]); }

  function chunkCard(c, k) {
    const card = el('div', { class: 'tz-chunk' + (c.added ? ' added' : '') });
    card.dataset.chunk = String(k);
    card.append(el('div', { class: 'tz-chunk-head' }, [el('b', { class: 'tz-piece', text: c.label }),
      el('span', { class: 'muted', text: c.added ? ' an added token, matched whole' : ` ${c.bytes.length} ${c.bytes.length === 1 ? 'byte' : 'bytes'}: ${c.bytes.map(hex).join(' ')}` })]));
    const steps = el('ol', { class: 'tz-merges' });
    if (!c.added) steps.append(el('li', {}, [el('span', { class: 'muted', text: 'start: ' }), chips(c.start)]));
    for (const m of c.merges) {
      steps.append(el('li', {}, [el('span', { class: 'tz-rank', text: `merge rank ${m.rank}: ` }),
        el('span', { class: 'tz-piece', text: m.left }), ' + ', el('span', { class: 'tz-piece', text: m.right }),
        ...(m.pieces ? [' → ', chips(m.pieces)] : [])]));
    }
    if (!c.added && !c.merges.length) steps.append(el('li', { class: 'muted', text: c.bytes.length > 1 ? 'no merge applies (or the chunk is a token of its own)' : 'one byte: nothing to merge' }));
    card.append(steps);
    card.append(el('div', { class: 'tz-ids' }, c.ids.map((id, j) => el('span', { class: 'tz-id' }, [el('span', { class: 'tz-piece', text: c.pieces[j] }), el('code', { text: String(id) })]))));
    return card;
  }

  function draw() {
    const sec = $('view-tokenizer'), data = P().tokenizer;
    if (!sec) return;
    clear(sec);
    sec.hidden = !data;
    if (!data) return;
    sec.append(el('h2', {}, [el('span', { class: 'n', text: '10' }), ' Tokenizer: from text to ids']));
    sec.append(el('p', { class: 'lede', text: LEDE }));
    if (data.kind === 'words') { drawWords(sec, data); return; }
    if (data.error) { sec.append(el('p', { class: 'note', id: 'tokenizer-error', text: data.error })); return; }
    const ids = el('div', { id: 'tokenizer-ids', class: 'tz-pieces' });
    ids.dataset.ids = JSON.stringify(data.ids);
    data.chunks.forEach((c, k) => c.ids.forEach((id, j) => ids.append(el('span', { class: 'tz-id', dataset: { chunk: String(k) } }, [el('span', { class: 'tz-piece', text: c.pieces[j] }), el('code', { text: String(id) })]))));
    sec.append(el('div', { id: 'tokenizer', class: 'tz' }, [
      stage('text', el('span', { class: 'tz-piece tz-text', text: data.label })),
      stage(`UTF-8: ${data.bytes.length} bytes`, el('code', { class: 'tz-bytes', text: data.bytes.map(hex).join(' ') })),
      stage(`pre-tokenizer: ${data.chunks.length} ${data.chunks.length === 1 ? 'chunk' : 'chunks'}`, chips(data.chunks.map((c) => c.label))),
      stage('BPE merges, chunk by chunk', el('div', { class: 'tz-chunks' }, data.chunks.map(chunkCard))),
      stage(`ids: ${data.ids.length} tokens`, ids),
    ]));
    onToken();
  }

  // A word-level tokenizer (the walkthrough's toy one): no bytes and no merges, each word is looked
  // up whole in the vocabulary (viewer/source.py word_view).
  function drawWords(sec, data) {
    sec.querySelector('.lede').textContent = 'How the sentence became the ids the model reads. This model ' +
      'has a word-level tokenizer, as the walkthrough\'s toy model does: the text is split at each space, ' +
      'and each word is looked up whole in a fixed vocabulary (no bytes, no merges); a word outside it ' +
      'cannot be read. A real model\'s byte-level BPE tokenizer builds its pieces from bytes instead.';
    if (data.error) { sec.append(el('p', { class: 'note', id: 'tokenizer-error', text: data.error })); return; }
    const ids = el('div', { id: 'tokenizer-ids', class: 'tz-pieces' });
    ids.dataset.ids = JSON.stringify(data.ids);
    data.words.forEach((w, k) => ids.append(el('span', { class: 'tz-id', dataset: { chunk: String(k) } }, [el('span', { class: 'tz-piece', text: w.piece }), el('code', { text: String(w.id) })])));
    sec.append(el('div', { id: 'tokenizer', class: 'tz' }, [
      stage('text', el('span', { class: 'tz-piece tz-text', text: data.label })),
      stage(`split at spaces: ${data.words.length} ${data.words.length === 1 ? 'word' : 'words'}`,
        el('div', { class: 'tz-chunks' }, data.words.map((w, k) => el('div', { class: 'tz-chunk', dataset: { chunk: String(k) } },
          [el('b', { class: 'tz-piece', text: w.text }), el('span', { class: 'muted', text: ` → vocabulary entry ${w.id}` + (data.vocab_size ? ` of ${data.vocab_size}` : '') })])))),
      stage(`ids: ${data.ids.length} tokens`, ids),
    ]));
    onToken();
  }

  // The selected token's chunk (its word) and id are marked.
  function onToken() {
    const data = P().tokenizer;
    if (!data || data.error) return;
    if (data.kind === 'words') {
      document.querySelectorAll('#tokenizer .sel').forEach((e) => e.classList.remove('sel'));
      document.querySelectorAll(`#tokenizer [data-chunk="${G.state.token}"]`).forEach((e) => e.classList.add('sel'));
      return;
    }
    let t = G.state.token, k = 0;
    for (; k < data.chunks.length && t >= data.chunks[k].ids.length; k++) t -= data.chunks[k].ids.length;
    document.querySelectorAll('#tokenizer .sel').forEach((e) => e.classList.remove('sel'));
    document.querySelectorAll(`#tokenizer .tz-chunk[data-chunk="${k}"]`).forEach((e) => e.classList.add('sel'));
    const chip = document.querySelectorAll('#tokenizer-ids .tz-id')[G.state.token];
    if (chip) chip.classList.add('sel');
  }

  G.view({ draw, onToken });
})();
