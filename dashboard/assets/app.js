// The dashboard's entry: hash routes (#/cluster, #/models, #/chat,
// #/events), the banner (node lost, election, connection lost) and the
// connection indicator. Every page is mounted once and kept, so a chat
// keeps streaming while another page is shown.

import { h, setChildren } from './dom.js';
import { apiKey, onAuthNeeded, setApiKey } from './api.js';
import { live, lostNodes, onStatus, start } from './live.js';
import * as cluster from './cluster.js';
import * as models from './models.js';
import * as chat from './chat.js';
import * as events from './events.js';

const PAGES = { cluster, models, chat, events };
const mounted = new Set();

function route() {
  const name = (location.hash.match(/^#\/(\w+)/) || [])[1];
  const page = PAGES[name] ? name : 'cluster';
  for (const key of Object.keys(PAGES)) {
    const section = document.getElementById(`page-${key}`);
    const active = key === page;
    if (active && !mounted.has(key)) {
      PAGES[key].mount(section);
      mounted.add(key);
    }
    section.hidden = !active;
    const link = document.querySelector(`[data-testid="nav-${key}"]`);
    if (active) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  if (PAGES[page].shown) PAGES[page].shown();
  document.title = `${page.charAt(0).toUpperCase()}${page.slice(1)} · tessera`;
}

function renderBanner() {
  const banner = document.getElementById('banner');
  const items = [];
  if (live.everConnected && !live.connected) {
    items.push({ tone: 'warn', text: 'Connection to the node lost — reconnecting…' });
  } else if (!live.everConnected && !live.connected && live.triedOnce) {
    items.push({ tone: 'warn', text: 'Cannot reach the node — retrying…' });
  }
  if (live.connected && live.snapshot?.cluster?.electing) {
    items.push({ tone: 'warn', text: 'The cluster is electing a master: changes wait until one is chosen.' });
  }
  for (const [id, name] of lostNodes()) {
    items.push({ tone: 'bad', text: `Node ${name} (${id.slice(0, 8)}) was lost: it no longer reports to the cluster.`, dismiss: id });
  }
  banner.hidden = items.length === 0;
  setChildren(banner, items.map((item) => h('div', { class: `banner-item tone-${item.tone}` },
    h('span', { text: item.text }),
    item.dismiss ? h('button', {
      class: 'btn btn-small btn-ghost', type: 'button', text: 'Dismiss',
      'aria-label': `Dismiss the notice about node ${item.text}`,
      on: { click: () => { live.dismissed.add(item.dismiss); renderBanner(); } },
    }) : null)));
}

function renderConn() {
  const conn = document.getElementById('conn');
  const c = live.snapshot?.cluster;
  conn.className = `conn ${live.connected ? 'conn-ok' : 'conn-bad'}`;
  conn.querySelector('.conn-text').textContent = live.connected
    ? `live · event ${live.snapshot?.last_index ?? 0}${c?.electing ? ' · electing' : ''}`
    : 'offline';
}

/** The API key form: shown while the node refuses for want of a key. */
function setupAuth() {
  const form = document.getElementById('auth');
  const input = document.getElementById('api-key');
  onAuthNeeded((needed) => {
    if (needed && form.hidden) {
      document.getElementById('auth-label').textContent = apiKey()
        ? 'The node refused this browser\'s API key: give another'
        : 'This node needs an API key';
    }
    form.hidden = !needed;
  });
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    setApiKey(input.value.trim());
    input.value = '';
    form.hidden = true; // the streams retry with it; a refusal shows the form again
  });
}

setupAuth();
onStatus(() => { renderBanner(); renderConn(); });
// The first failure before any answer shows the "cannot reach" notice.
setTimeout(() => { live.triedOnce = true; renderBanner(); }, 3000);
window.addEventListener('hashchange', route);
route();
start();
