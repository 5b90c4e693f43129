// The live cluster: one EventSource on /state/stream (the whole state on
// each change) feeds every page; it also tracks the connection and the
// nodes seen, so a node that vanishes shows as lost.

import { openStream } from './api.js';

const listeners = new Set();
const statusListeners = new Set();

export const live = {
  snapshot: null, // {last_index, digest, state, cluster}
  connected: false,
  everConnected: false,
  triedOnce: false, // set a few seconds after start: "cannot reach" shows only then
  seen: new Map(), // node id -> hostname, every node seen since the page opened
  dismissed: new Set(),
};

export function onSnapshot(fn) {
  listeners.add(fn);
  if (live.snapshot) fn(live.snapshot);
}

export function onStatus(fn) {
  statusListeners.add(fn);
  fn(live);
}

function publish(snapshot) {
  live.snapshot = snapshot;
  for (const [id, node] of Object.entries(snapshot.state?.nodes || {})) {
    live.seen.set(id, node.info?.hostname || id);
  }
  for (const fn of listeners) {
    try { fn(snapshot); } catch (e) { console.warn('render failed', e); }
  }
  notify();
}

function setConnected(value) {
  live.connected = value;
  if (value) live.everConnected = true;
  notify();
}

function notify() {
  for (const fn of statusListeners) fn(live);
}

/** Nodes seen before that the state no longer has. */
export function lostNodes() {
  const nodes = live.snapshot?.state?.nodes || {};
  return [...live.seen].filter(([id]) => !(id in nodes) && !live.dismissed.has(id));
}

export function start() {
  openStream('/state/stream', {
    onOpen: () => setConnected(true),
    onMessage: (data) => {
      setConnected(true);
      try { publish(JSON.parse(data)); } catch (e) { console.warn('bad state message', e); }
    },
    onError: () => setConnected(false),
  });
}
