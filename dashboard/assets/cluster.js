// Cluster page: every node (name, OS, cores, memory as a bar, master), its
// instances and runners with their state, and the links between nodes.

import { h, renderList, setChildren, fmtBytes, shortId, enumLabel } from './dom.js';
import { onSnapshot } from './live.js';
import { instanceState, nodeName, runnerState, shardText } from './cluster-state.js';

let els = null;

export function mount(root) {
  els = {
    summary: h('p', { class: 'muted', id: 'cluster-summary', text: 'Waiting for the node…' }),
    nodes: h('div', { class: 'node-grid', 'aria-label': 'Nodes' }),
    links: h('div', { class: 'card' }),
  };
  setChildren(root,
    h('div', { class: 'page-head' }, h('h1', { id: 'h-cluster', text: 'Cluster' }), els.summary),
    els.nodes,
    h('h2', { text: 'Links' }),
    els.links);
  onSnapshot(render);
}

function render(snapshot) {
  const { state, cluster } = snapshot;
  const nodeIds = Object.keys(state.nodes || {}).sort();
  const master = cluster?.master || state.session?.masterNodeId || null;
  const instances = Object.keys(state.instances || {}).length;
  els.summary.textContent = `${nodeIds.length} ${nodeIds.length === 1 ? 'node' : 'nodes'} · `
    + `${instances} ${instances === 1 ? 'instance' : 'instances'} · master ${master ? nodeName(state, master) : 'none (electing)'}`
    + ` · election clock ${cluster?.election_clock ?? state.session?.electionClock ?? 0}`
    + (cluster ? ` · ${cluster.secured ? 'secured (mutual TLS)' : 'open (not secured)'}` : '');
  renderList(els.nodes, nodeIds, (id) => id,
    (id) => JSON.stringify([state.nodes[id], master, cluster?.node_id, nodeInstancesSig(state, id)]),
    (id) => nodeCard(state, id, { master, self: cluster?.node_id }));
  setChildren(els.links, linksTable(state));
}

function nodeInstancesSig(state, nodeId) {
  return Object.values(state.instances || {})
    .filter((i) => (i.ranks || []).some((r) => r.nodeId === nodeId))
    .map((i) => [i.instanceId, (i.ranks || []).map((r) => state.runners?.[r.runnerId])]);
}

/** One node's card; also used by the Events page's time travel. */
export function nodeCard(state, nodeId, { master, self } = {}) {
  const info = state.nodes[nodeId]?.info || {};
  const total = Number(info.memoryTotalBytes) || 0;
  const used = Math.max(0, total - (Number(info.memoryAvailableBytes) || 0));
  const meterId = `mem-${nodeId}-${Math.random().toString(36).slice(2, 7)}`;
  const instances = Object.values(state.instances || {})
    .filter((i) => (i.ranks || []).some((r) => r.nodeId === nodeId));
  return h('article', { class: 'card node-card', testid: 'node-card', 'data-node-id': nodeId },
    h('header', { class: 'node-head' },
      h('h3', { text: info.hostname || shortId(nodeId) }),
      nodeId === master ? h('span', { class: 'badge badge-accent', testid: 'node-master', text: 'master' }) : null,
      nodeId === self ? h('span', { class: 'badge', text: 'this node' }) : null,
      info.noWorker ? h('span', { class: 'badge', text: 'no worker' }) : null),
    h('p', { class: 'mono muted small', title: nodeId, text: nodeId }),
    h('dl', { class: 'facts' },
      fact('OS', [info.os, info.osVersion].filter(Boolean).join(' ') || '—'),
      fact('CPU', `${info.cpuCores || 0} cores · ${info.cpuModel || '?'}`),
      fact('Backends', (info.engineBackends || []).map((b) => enumLabel(b, 'ENGINE_BACKEND_')).join(', ') || '—'),
      fact('GPUs', (info.gpus || []).map(gpuLabel).join('; ') || 'none'),
      fact('Device', info.device || 'auto'),
      fact('Decode speed', Number(info.decodeBytesPerSecond || 0) > 0
        ? `${fmtBytes(Number(info.decodeBytesPerSecond))}/s of weights` : 'not measured yet'),
      fact('Disk free', fmtBytes(info.diskAvailableBytes)),
      fact('Version', info.tesseraVersion || '—')),
    h('div', { class: 'mem' },
      h('label', { for: meterId, class: 'small', text: `Memory ${fmtBytes(used)} used of ${fmtBytes(total)}` }),
      h('meter', { id: meterId, testid: 'memory-bar', min: 0, max: total || 1, value: used,
        low: total * 0.7, high: total * 0.9, optimum: 0 })),
    h('div', { class: 'node-instances' },
      h('h4', { text: instances.length ? 'Instances' : 'No instances' }),
      instances.map((i) => instanceRow(state, i, nodeId))));
}

/** An adapter as `gpu:N name (backend, kind, memory)`. */
function gpuLabel(gpu) {
  const bytes = Number(gpu.memoryBytes || 0);
  const memory = bytes === 0 ? 'memory unknown'
    : `${fmtBytes(bytes)}${gpu.unifiedMemory ? ' shared' : ''}`;
  return `gpu:${gpu.index || 0} ${gpu.name} (${gpu.backend}, ${gpu.kind}, ${memory})`;
}

function fact(term, value) {
  return [h('dt', { text: term }), h('dd', { text: value })];
}

/** An instance with each rank's runner state (only `onNode`'s ranks if set). */
export function instanceRow(state, instance, onNode) {
  const st = instanceState(state, instance);
  const ranks = (instance.ranks || []).map((r, i) => ({ ...r, rank: r.rank ?? i }))
    .filter((r) => !onNode || r.nodeId === onNode);
  return h('div', { class: 'instance-row', testid: 'instance-row', 'data-instance-id': instance.instanceId },
    h('div', { class: 'row-head' },
      h('span', { class: 'strong', text: instance.model?.modelId || '?' }),
      h('span', { class: `pill tone-${st.tone}`, text: st.text })),
    h('div', { class: 'muted small mono', text: `${instance.instanceId} · ${enumLabel(instance.sharding, 'SHARDING_')}` }),
    h('ul', { class: 'ranks' }, ranks.map((r) => {
      const rs = runnerState(state.runners?.[r.runnerId]);
      return h('li', {},
        h('span', { class: 'small', text: `rank ${r.rank} · ${nodeName(state, r.nodeId)} · ${shardText(r.shard)}` }),
        h('span', { class: `pill tone-${rs.tone}`, testid: 'runner-state', title: r.runnerId, text: rs.text }));
    })));
}

function linksTable(state) {
  const edges = state.topology || [];
  if (!edges.length) {
    const n = Object.keys(state.nodes || {}).length;
    return h('p', { class: 'muted', text: n > 1 ? 'No links measured yet.' : 'One node: no links between nodes.' });
  }
  return h('div', { class: 'table-wrap' }, h('table', {},
    h('thead', {}, h('tr', {}, ['From', 'To', 'Address', 'Kind', 'Latency'].map((t) => h('th', { scope: 'col', text: t })))),
    h('tbody', {}, edges.map((e) => h('tr', {},
      h('td', { text: nodeName(state, e.sourceNodeId) }),
      h('td', { text: nodeName(state, e.sinkNodeId) }),
      h('td', { class: 'mono', text: e.address || '' }),
      h('td', { text: enumLabel(e.kind, 'LINK_KIND_') || '—' }),
      h('td', { text: Number(e.latencyUs) ? `${(Number(e.latencyUs) / 1000).toFixed(2)} ms` : '—' }))))));
}
