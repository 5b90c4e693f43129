// Reading the cluster state (protobuf JSON: lowerCamelCase, 64-bit numbers
// as strings, oneofs as one key) into what the pages show.

/** The oneof key of an object: {"loading": {...}} -> "loading". */
export function oneofKind(obj, skip = []) {
  if (!obj) return '';
  return Object.keys(obj).find((k) => !skip.includes(k)) || '';
}

const RUNNER_LABELS = {
  idle: 'Idle', connecting: 'Connecting', connected: 'Connected', loading: 'Loading',
  loaded: 'Loaded', warmingUp: 'Warming up', ready: 'Ready', running: 'Running',
  shuttingDown: 'Shutting down', shutdown: 'Shut down', failed: 'Failed',
};

/** A runner's state as {kind, text, tone}; tone picks the colour. */
export function runnerState(status) {
  const kind = oneofKind(status);
  const body = (status && status[kind]) || {};
  let text = RUNNER_LABELS[kind] || 'Pending';
  if (kind === 'loading' && body.layersTotal) text = `Loading ${body.layersLoaded || 0}/${body.layersTotal}`;
  if (kind === 'running') {
    const n = (body.taskIds || []).length || 1;
    text = `Running (${n} ${n === 1 ? 'task' : 'tasks'})`;
  }
  if (kind === 'failed') text = `Failed: ${body.reason || 'unknown reason'}`;
  const tone = { ready: 'ok', running: 'busy', failed: 'bad', loading: 'warn', loaded: 'warn', warmingUp: 'warn',
    connecting: 'warn', connected: 'warn' }[kind] || 'idle';
  return { kind, text, tone, body };
}

/** Whether every rank's runner is ready or running (as the API decides). */
export function instanceReady(state, instance) {
  const ranks = instance.ranks || [];
  return ranks.length > 0 && ranks.every((r) => {
    const kind = oneofKind(state.runners?.[r.runnerId]);
    return kind === 'ready' || kind === 'running';
  });
}

/** The instance's state in a word: Ready, Failed, Loading n/m, Starting. */
export function instanceState(state, instance) {
  if (instanceReady(state, instance)) {
    const busy = (instance.ranks || []).some((r) => oneofKind(state.runners?.[r.runnerId]) === 'running');
    return { text: busy ? 'Ready · running' : 'Ready', tone: 'ok' };
  }
  const states = (instance.ranks || []).map((r) => runnerState(state.runners?.[r.runnerId]));
  const failed = states.find((s) => s.kind === 'failed');
  if (failed) return { text: failed.text, tone: 'bad' };
  const loading = states.find((s) => s.kind === 'loading');
  if (loading) return { text: loading.text, tone: 'warn' };
  const other = states.find((s) => s.kind && s.kind !== 'ready' && s.kind !== 'running');
  return { text: other ? other.text : 'Starting', tone: 'warn' };
}

export function nodeName(state, nodeId) {
  return state?.nodes?.[nodeId]?.info?.hostname || nodeId?.slice(0, 8) || '?';
}

export function shardText(shard) {
  if (shard?.pipeline) {
    const p = shard.pipeline;
    return `layers ${p.startLayer || 0}–${p.endLayer || 0} of ${p.nLayers || 0}`;
  }
  if (shard?.tensor) return `tensor rank ${shard.tensor.rank || 0} of ${shard.tensor.worldSize || 1}`;
  return '';
}

/** Model ids with at least one ready instance. */
export function readyModels(state) {
  const ids = new Set();
  for (const inst of Object.values(state?.instances || {})) {
    if (instanceReady(state, inst)) ids.add(inst.model?.modelId);
  }
  return [...ids].filter(Boolean).sort();
}

/** Each node's download of `modelId`: [{nodeId, progress}]. */
export function downloadsOf(state, modelId) {
  return Object.entries(state?.downloads || {})
    .map(([nodeId, d]) => ({ nodeId, progress: d?.models?.[modelId] }))
    .filter((d) => d.progress);
}
