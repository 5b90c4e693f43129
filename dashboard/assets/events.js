// Events page: the indexed event log as it happens (newest first, at most
// MAX_EVENTS kept), filters by kind, node and instance, and time travel:
// the cluster state folded from the log up to an index (/state/at).

import { h, setChildren, errorBox, fmtBytes, enumLabel, shortId } from './dom.js';
import { getJson, openStream } from './api.js';
import { onSnapshot, live } from './live.js';
import { instanceRow } from './cluster.js';
import { oneofKind, runnerState, nodeName } from './cluster-state.js';

const MAX_EVENTS = 2000;

let els = null;
const events = []; // oldest first, each {index, kind, nodes, instances, summary}
let lastIndex = 0;
let pending = [];
let stream = null;
const seen = { kinds: new Set(), nodes: new Set(), instances: new Set() };
// Who a runner or task belongs to, learnt from the state and the log, so an
// event naming only a runner or task can be filtered by node and instance.
const runnerOwner = new Map(); // runner id -> {instanceId, nodeId}
const taskInstance = new Map(); // task id -> instance id

export function mount(root) {
  const filter = (id, label, testid) => {
    const select = h('select', { id, testid, on: { change: rerender } }, h('option', { value: '', text: `All` }));
    return { select, el: h('div', { class: 'field' }, h('label', { for: id, text: label }), select) };
  };
  const kind = filter('ev-kind', 'Kind', 'event-filter-kind');
  const node = filter('ev-node', 'Node', 'event-filter-node');
  const instance = filter('ev-instance', 'Instance', 'event-filter-instance');
  const ttIndex = h('input', { id: 'tt-index', testid: 'timetravel-index', type: 'number', min: 1, step: 1, inputmode: 'numeric', placeholder: 'e.g. 12' });
  const ttGo = h('button', { class: 'btn btn-primary', type: 'submit', testid: 'timetravel-go', text: 'Show state' });
  els = {
    kind: kind.select, node: node.select, instance: instance.select, ttIndex,
    body: h('tbody', {}),
    count: h('p', { class: 'muted small', 'aria-live': 'polite' }),
    tt: h('div', { class: 'tt-state', testid: 'timetravel-state', 'aria-live': 'polite' },
      h('p', { class: 'muted', text: 'Pick an index (or a row of the log) to see the cluster as it was then.' })),
  };
  const ttForm = h('form', { class: 'tt-form', on: { submit: (e) => { e.preventDefault(); travel(); } } },
    h('div', { class: 'field' }, h('label', { for: 'tt-index', text: 'Event index' }), ttIndex),
    ttGo,
    h('button', { class: 'btn btn-ghost', type: 'button', text: 'Latest',
      on: { click: () => { ttIndex.value = live.snapshot?.last_index || lastIndex || 1; travel(); } } }));
  setChildren(root,
    h('div', { class: 'page-head' }, h('h1', { id: 'h-events', text: 'Events' }),
      h('p', { class: 'muted', text: 'Everything the cluster did, in the order the master indexed it.' })),
    h('section', { class: 'card', 'aria-labelledby': 'h-tt' },
      h('h2', { id: 'h-tt', text: 'Time travel' }),
      h('p', { class: 'muted small', text: 'The state folded from the log up to an index, as tessera replay --until N computes it.' }),
      ttForm, els.tt),
    h('section', { class: 'card', 'aria-labelledby': 'h-log' },
      h('div', { class: 'row-head' }, h('h2', { id: 'h-log', text: 'Log' }), els.count),
      h('div', { class: 'filters' }, kind.el, node.el, instance.el),
      h('div', { class: 'table-wrap log-wrap' }, h('table', { class: 'log' },
        h('thead', {}, h('tr', {}, ['Index', 'Kind', 'Node', 'Instance', 'What'].map((t) => h('th', { scope: 'col', text: t })))),
        els.body))));
  onSnapshot(learnOwners);
  onSnapshot(startStream);
}

function startStream(snapshot) {
  if (stream) return;
  const from = Math.max(1, Number(snapshot.last_index || 0) - MAX_EVENTS + 1);
  // On a reconnect, go on after the last event seen.
  stream = openStream(() => `/events?from=${lastIndex ? lastIndex + 1 : from}`, {
    onMessage: (data) => {
      try { queue(JSON.parse(data)); } catch (e) { console.warn('bad event', e); }
    },
  });
}

function learnOwners({ state }) {
  for (const inst of Object.values(state.instances || {})) learnInstance(inst);
  for (const [id, t] of Object.entries(state.tasks || {})) if (t.instanceId) taskInstance.set(id, t.instanceId);
}

function learnInstance(inst) {
  for (const r of inst.ranks || []) runnerOwner.set(r.runnerId, { instanceId: inst.instanceId, nodeId: r.nodeId });
}

function queue(indexed) {
  const index = Number(indexed.index);
  if (index <= lastIndex) return; // seen already (a reconnect may repeat one)
  lastIndex = index;
  pending.push(indexed);
  if (pending.length === 1) requestAnimationFrame(flush);
}

/** Adds what came since the last frame, in one DOM update. */
function flush() {
  const batch = pending;
  pending = [];
  const fragment = document.createDocumentFragment();
  for (const indexed of batch) {
    const ev = describe(indexed);
    events.push(ev);
    addOptions(ev);
    if (matches(ev)) fragment.prepend(row(ev));
  }
  while (events.length > MAX_EVENTS) events.shift();
  els.body.prepend(fragment);
  while (els.body.children.length > MAX_EVENTS) els.body.lastElementChild.remove();
  updateCount();
}

function rerender() {
  const fragment = document.createDocumentFragment();
  for (let i = events.length - 1; i >= 0; i--) if (matches(events[i])) fragment.append(row(events[i]));
  els.body.replaceChildren(fragment);
  updateCount();
}

function updateCount() {
  els.count.textContent = `${els.body.children.length} shown of ${events.length} kept · last index ${lastIndex}`;
}

function matches(ev) {
  return (!els.kind.value || ev.kind === els.kind.value)
    && (!els.node.value || ev.nodes.has(els.node.value))
    && (!els.instance.value || ev.instances.has(els.instance.value));
}

function addOptions(ev) {
  const add = (set, select, value, label) => {
    if (!value || set.has(value)) return;
    set.add(value);
    select.append(h('option', { value, text: label }));
  };
  add(seen.kinds, els.kind, ev.kind, kindLabel(ev.kind));
  for (const n of ev.nodes) add(seen.nodes, els.node, n, `${nodeName(live.snapshot?.state, n)} (${n.slice(0, 8)})`);
  for (const i of ev.instances) add(seen.instances, els.instance, i, i);
}

/** "taskStatusUpdated" -> "Task status updated" */
function kindLabel(kind) {
  const s = kind.replace(/([A-Z])/g, ' $1').toLowerCase();
  return s.charAt(0).toUpperCase() + s.slice(1);
}

/** Every value of `key` anywhere in `obj`. */
function collect(obj, key, out, depth = 0) {
  if (!obj || typeof obj !== 'object' || depth > 6) return out;
  for (const [k, v] of Object.entries(obj)) {
    if (k === key && typeof v === 'string' && v) out.add(v);
    else if (typeof v === 'object') collect(v, key, out, depth + 1);
  }
  return out;
}

function describe(indexed) {
  const kind = oneofKind(indexed.event);
  const body = indexed.event?.[kind] || {};
  if (kind === 'instanceCreated' && body.instance) learnInstance(body.instance);
  if (kind === 'taskCreated' && body.task?.instanceId) taskInstance.set(body.task.taskId, body.task.instanceId);
  const nodes = collect(body, 'nodeId', new Set());
  if (indexed.originNodeId) nodes.add(indexed.originNodeId);
  const instances = collect(body, 'instanceId', new Set());
  const owner = runnerOwner.get(body.runnerId);
  if (owner) { instances.add(owner.instanceId); nodes.add(owner.nodeId); }
  const taskId = body.taskId || body.task?.taskId;
  if (taskId && taskInstance.has(taskId)) instances.add(taskInstance.get(taskId));
  return { index: Number(indexed.index), kind, nodes, instances, summary: summary(kind, body) };
}

const TASK_KINDS = ['createRunner', 'downloadModel', 'connectToGroup', 'loadModel', 'startWarmup', 'textGeneration', 'cancelTask', 'shutdown'];

function summary(kind, b) {
  const state = live.snapshot?.state;
  switch (kind) {
    case 'nodeGatheredInfo':
      return `${b.info?.hostname || '?'}: ${fmtBytes(b.info?.memoryAvailableBytes)} of ${fmtBytes(b.info?.memoryTotalBytes)} free`;
    case 'nodeTimedOut': return `node ${nodeName(state, b.nodeId)} timed out (lost)`;
    case 'topologyEdgeCreated':
    case 'topologyEdgeDeleted':
      return `${nodeName(state, b.edge?.sourceNodeId)} → ${nodeName(state, b.edge?.sinkNodeId)} ${b.edge?.address || ''}`;
    case 'instanceCreated': {
      const i = b.instance || {};
      return `${i.model?.modelId || '?'} · ${enumLabel(i.sharding, 'SHARDING_')} · ${(i.ranks || []).length} rank(s)`;
    }
    case 'instanceDeleted': return `${b.instanceId}${b.reason ? ` — ${b.reason}` : ''}`;
    case 'runnerStatusUpdated': return `${b.runnerId} → ${runnerState(b.status).text}`;
    case 'runnerDeleted': return b.runnerId;
    case 'taskCreated': {
      const t = b.task || {};
      const tk = TASK_KINDS.find((k) => t[k]) || 'task';
      const extra = t.textGeneration ? ` · ${t.textGeneration.params?.modelId || ''}` : '';
      return `${kindLabel(tk)} ${shortId(t.taskId)}${extra}`;
    }
    case 'taskAcknowledged': return `task ${shortId(b.taskId)}`;
    case 'taskStatusUpdated':
      return `task ${shortId(b.taskId)} → ${enumLabel(b.status, 'TASK_STATUS_')}${b.error ? ` — ${b.error}` : ''}`;
    case 'taskDeleted': return `task ${shortId(b.taskId)}`;
    case 'nodeDownloadProgress': {
      const p = b.progress || {};
      const k = oneofKind(p, ['modelId', 'shards']);
      const o = p[k] || {};
      const bytes = k === 'ongoing' ? ` ${fmtBytes(o.downloadedBytes)} / ${fmtBytes(o.totalBytes)}` : '';
      return `${p.modelId} on ${nodeName(state, b.nodeId)}: ${k}${bytes}${o.reason ? ` — ${o.reason}` : ''}`;
    }
    case 'modelCardAdded': return b.card?.modelId || '';
    default: return JSON.stringify(b).slice(0, 160);
  }
}

function row(ev) {
  const state = live.snapshot?.state;
  return h('tr', { testid: 'event-row', 'data-index': ev.index, 'data-kind': ev.kind },
    h('td', {}, h('button', { class: 'link-btn mono', type: 'button', text: String(ev.index),
      'aria-label': `Show the state at index ${ev.index}`, title: 'Time travel to this index',
      on: { click: () => { els.ttIndex.value = ev.index; travel(); els.ttIndex.focus(); } } })),
    h('td', {}, h('span', { class: `kind kind-${ev.kind}`, text: kindLabel(ev.kind) })),
    h('td', { class: 'small', text: [...ev.nodes].map((n) => nodeName(state, n)).join(', ') }),
    h('td', { class: 'small mono', text: [...ev.instances].join(', ') }),
    h('td', { class: 'small', text: ev.summary }));
}

async function travel() {
  const index = Number(els.ttIndex.value);
  if (!Number.isInteger(index) || index < 0) {
    setChildren(els.tt, errorBox('Give a whole number: an event index.'));
    return;
  }
  setChildren(els.tt, h('p', { class: 'muted', text: `Folding the log up to ${index}…` }));
  try {
    const reply = await getJson(`/state/at?index=${index}`);
    setChildren(els.tt, pastState(reply));
  } catch (e) {
    setChildren(els.tt, errorBox(e.message));
  }
}

function pastState(reply) {
  const state = reply.state || {};
  const nodes = Object.entries(state.nodes || {});
  const instances = Object.values(state.instances || {});
  const runners = Object.entries(state.runners || {});
  const tasks = Object.values(state.tasks || {});
  const master = state.session?.masterNodeId;
  return h('div', { class: 'tt-result', 'data-index': reply.index },
    h('p', { class: 'small' }, h('span', { class: 'strong', text: `State at index ${reply.index}` }),
      h('span', { class: 'muted mono', text: ` · digest ${String(reply.digest || '').slice(0, 16)}` })),
    h('div', { class: 'tt-grid' },
      h('div', {}, h('h3', { text: `Nodes (${nodes.length})` }),
        nodes.length ? h('ul', { class: 'plain' }, nodes.map(([id, n]) => h('li', { class: 'small', 'data-node-id': id },
          h('span', { class: 'strong', text: n.info?.hostname || shortId(id) }),
          id === master ? h('span', { class: 'badge badge-accent', text: 'master' }) : null,
          h('span', { class: 'muted', text: ` ${fmtBytes(Number(n.info?.memoryTotalBytes) - Number(n.info?.memoryAvailableBytes))} of ${fmtBytes(n.info?.memoryTotalBytes)} used` }))))
          : h('p', { class: 'muted small', text: 'none' })),
      h('div', {}, h('h3', { text: `Instances (${instances.length})` }),
        instances.length ? instances.map((i) => instanceRow(state, i)) : h('p', { class: 'muted small', text: 'none' })),
      h('div', {}, h('h3', { text: `Runners (${runners.length}) · tasks (${tasks.length})` }),
        runners.length ? h('ul', { class: 'plain' }, runners.map(([id, st]) => {
          const rs = runnerState(st);
          return h('li', { class: 'small' }, h('span', { class: 'mono', text: `${id} ` }),
            h('span', { class: `pill tone-${rs.tone}`, text: rs.text }));
        })) : h('p', { class: 'muted small', text: 'none' }))));
}
