// DOM and formatting helpers. Every text from the server or a model goes
// in through textContent (here, via h()), never innerHTML: no XSS.

/** h('div', {class, testid, on: {click}, ...attrs}, ...children) */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'class') el.className = value;
    else if (key === 'text') el.textContent = String(value);
    else if (key === 'testid') el.dataset.testid = value;
    else if (key === 'on') for (const [ev, fn] of Object.entries(value)) el.addEventListener(ev, fn);
    else if (key === 'dataset') Object.assign(el.dataset, value);
    else if (['value', 'checked', 'disabled', 'hidden', 'selected', 'open', 'max', 'min'].includes(key)) el[key] = value;
    else el.setAttribute(key, value === true ? '' : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replaces every child of `el`. */
export function setChildren(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

/**
 * Keeps a keyed list in `container` up to date without rebuilding rows that
 * did not change (so focus and open <details> survive a live update): a row
 * is rebuilt only when its signature differs.
 */
export function renderList(container, items, key, signature, render) {
  const old = new Map();
  for (const el of container.children) if (el.dataset.key !== undefined) old.set(el.dataset.key, el);
  const rows = items.map((item) => {
    const k = String(key(item));
    const sig = signature(item);
    const prev = old.get(k);
    if (prev && prev.dataset.sig === sig) return prev;
    const el = render(item, prev);
    el.dataset.key = k;
    el.dataset.sig = sig;
    return el;
  });
  // Move or insert in order; drop what is gone.
  rows.forEach((el, i) => {
    if (container.children[i] !== el) container.insertBefore(el, container.children[i] || null);
  });
  while (container.children.length > rows.length) container.lastElementChild.remove();
}

export function fmtBytes(value) {
  const n = Number(value) || 0;
  if (n < 1024) return `${n} B`;
  const units = ['KiB', 'MiB', 'GiB', 'TiB'];
  let v = n / 1024;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v >= 100 ? 0 : 1)} ${units[i]}`;
}

export function fmtDuration(ms) {
  const s = Math.round((Number(ms) || 0) / 1000);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

export function shortId(id) {
  return id && id.length > 13 ? `${id.slice(0, 8)}…${id.slice(-4)}` : id || '';
}

/** "SHARDING_PIPELINE" -> "Pipeline". */
export function enumLabel(value, prefix) {
  const s = String(value || '').replace(prefix, '').toLowerCase().replace(/_/g, ' ');
  return s.charAt(0).toUpperCase() + s.slice(1);
}

/** An inline error box (role=alert so screen readers announce it). */
export function errorBox(message) {
  return h('div', { class: 'error', role: 'alert', testid: 'error-message', text: message });
}

/** Shows (or clears, with '') an error in a slot element. */
export function showError(slot, error) {
  const message = error ? (error.message || String(error)) : '';
  setChildren(slot, message ? errorBox(message) : null);
}
