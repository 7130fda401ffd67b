// glassformer explorer: the page at every screen size. The section menu (#section-menu: one link
// per section shown, numbered in page order), the calculation panel #explain as a drawer over the
// bottom of the screen when the page is too narrow for it to stand beside the sections (below
// 1100 px, glass.css), and the keyboard: every number is a button (Tab reaches it, Enter opens
// its calculation), Escape closes the drawer and gives the focus back to the number it came from.
// Safety: as in glass.js, data reaches the page through text nodes only.
'use strict';
(function () {
  const G = window.Glass;
  const { el, clear, $ } = G;
  const NARROW = window.matchMedia('(max-width: 1099.98px)'); // glass.css's drawer rule, the same width
  let opener = null; // the number (or other control) whose calculation the panel shows

  // ------------------------------------------------------------------ the section menu
  function sections() { return Array.from(document.querySelectorAll('#views > section.view')).filter((s) => !s.hidden); }
  function titleOf(sec) {
    const h = sec.querySelector('h2');
    if (!h) return sec.id.replace(/^view-/, '');
    const copy = h.cloneNode(true);
    copy.querySelectorAll('.n, .badge').forEach((x) => x.remove());
    return copy.textContent.trim();
  }
  function menu() {
    let nav = $('section-menu');
    if (!nav) {
      nav = el('details', { id: 'section-menu', class: 'section-menu' }, [
        el('summary', { text: 'Sections' }), el('ol', { id: 'section-list' })]);
      document.querySelector('.layout').before(nav);
      // A chosen section closes the menu on a narrow screen, where it lies over the page.
      nav.addEventListener('click', (ev) => { if (ev.target.closest('a') && NARROW.matches) nav.open = false; });
    }
    return nav;
  }
  // Numbers follow the page's order (a section a script adds or hides renumbers the rest).
  function renumber() {
    menu();
    const list = clear($('section-list'));
    sections().forEach((sec, k) => {
      const n = sec.querySelector('h2 .n');
      if (n) n.textContent = String(k + 1);
      list.append(el('li', {}, el('a', { href: `#${sec.id}`, text: titleOf(sec), dataset: { section: sec.id } })));
    });
  }
  let pending = false;
  function later() { // after every view of this draw (map.js and tour.js draw after this file)
    if (pending) return;
    pending = true;
    setTimeout(() => { pending = false; renumber(); }, 0);
  }

  // ------------------------------------------------------------------ the calculation drawer
  const panel = $('explain');
  function open() {
    panel.classList.add('open');
    document.body.classList.toggle('drawer-open', NARROW.matches);
    if (NARROW.matches && opener && opener.isConnected && !panel.contains(opener)) {
      // The number stays in sight above the drawer.
      const r = opener.getBoundingClientRect(), top = window.innerHeight - panel.getBoundingClientRect().height;
      if (r.bottom > top - 8 || r.top < 0) window.scrollBy({ top: r.top - Math.max(60, (top - r.height) / 2), behavior: 'instant' });
    }
    if (opener && !panel.contains(document.activeElement)) $('explain-title').focus({ preventScroll: true });
  }
  function close() {
    if (!panel.classList.contains('open')) return;
    panel.classList.remove('open');
    document.body.classList.remove('drawer-open');
    if (opener && opener.isConnected) opener.focus({ preventScroll: !NARROW.matches });
  }
  // The panel is filled by glass.js (showCalc) after a click, at once or when the server answers.
  new MutationObserver(() => { if ($('explain-body').querySelector('.calc-title')) open(); })
    .observe($('explain-body'), { childList: true });
  document.addEventListener('click', (ev) => {
    const t = ev.target.closest && ev.target.closest('button, [role=button], .rms, .cell');
    if (t && !panel.contains(t)) opener = t;
  }, true);
  document.addEventListener('keydown', (ev) => {
    if (ev.key === 'Escape' && panel.classList.contains('open')) { ev.preventDefault(); close(); }
  });
  $('explain-close').addEventListener('click', () => close());
  NARROW.addEventListener('change', () => document.body.classList.toggle('drawer-open', NARROW.matches && panel.classList.contains('open')));

  G.view({ draw: later, onToken: later });
})();
