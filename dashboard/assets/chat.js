// Chat page: a ready model, streamed answers (fetch + ReadableStream over
// the SSE of /v1/chat/completions), thinking folded, tool calls, time to
// first token and tokens/s, prefill progress, stop, sampling settings,
// multi-turn, conversations kept in localStorage.

import { h, setChildren, errorBox } from './dom.js';
import { apiUrl, errorOf, headers, sseData } from './api.js';
import { onSnapshot } from './live.js';
import { readyModels } from './cluster-state.js';

const STORE_KEY = 'tessera.chat.conversations.v1';
const SETTINGS_KEY = 'tessera.chat.settings.v1';

let els = null;
let store = loadStore();
let running = null; // {controller} while an answer streams

function loadStore() {
  try {
    const s = JSON.parse(localStorage.getItem(STORE_KEY));
    if (s && Array.isArray(s.conversations)) {
      // An answer left streaming when the page closed was cut off there.
      for (const c of s.conversations) for (const m of c.messages) if (m.status === 'streaming') m.status = 'stopped';
      return s;
    }
  } catch { /* corrupt or absent: start afresh */ }
  return { current: null, conversations: [] };
}

function saveStore() {
  try { localStorage.setItem(STORE_KEY, JSON.stringify(store)); } catch { /* full or disabled: keep in memory */ }
}

function loadSettings() {
  try { return JSON.parse(localStorage.getItem(SETTINGS_KEY)) || {}; } catch { return {}; }
}

function saveSettings() {
  const s = { model: els.model.value, system: els.system.value, temperature: els.temperature.value,
    topP: els.topP.value, maxTokens: els.maxTokens.value };
  try { localStorage.setItem(SETTINGS_KEY, JSON.stringify(s)); } catch { /* ignore */ }
}

function current() {
  return store.conversations.find((c) => c.id === store.current) || null;
}

function field(id, label, input, hint) {
  input.id = id;
  return h('div', { class: 'field' }, h('label', { for: id, text: label }), input,
    hint ? h('p', { class: 'hint', text: hint }) : null);
}

export function mount(root) {
  const settings = loadSettings();
  els = {
    model: h('select', { testid: 'chat-model' }),
    system: h('textarea', { testid: 'chat-system', rows: 3, placeholder: 'Optional, e.g. “Answer briefly.”' }),
    temperature: h('input', { testid: 'chat-temperature', type: 'number', min: 0, max: 2, step: 0.1, placeholder: 'default' }),
    topP: h('input', { testid: 'chat-top-p', type: 'number', min: 0, max: 1, step: 0.05, placeholder: 'default' }),
    maxTokens: h('input', { testid: 'chat-max-tokens', type: 'number', min: 1, step: 1, placeholder: 'no limit' }),
    input: h('textarea', { id: 'chat-input', testid: 'chat-input', rows: 3, placeholder: 'Ask something… (Enter sends, Shift+Enter is a new line)' }),
    send: h('button', { class: 'btn btn-primary', type: 'submit', testid: 'chat-send', text: 'Send' }),
    stop: h('button', { class: 'btn btn-danger', type: 'button', testid: 'chat-stop', text: 'Stop', disabled: true }),
    list: h('ul', { class: 'conv-list', testid: 'conversation-list', 'aria-label': 'Conversations' }),
    messages: h('div', { class: 'messages', 'aria-live': 'polite', 'aria-label': 'Messages' }),
    status: h('div', { class: 'composer-status', 'aria-live': 'polite' }),
  };
  els.system.value = settings.system || '';
  els.temperature.value = settings.temperature ?? '';
  els.topP.value = settings.topP ?? '';
  els.maxTokens.value = settings.maxTokens ?? '';
  els.wantedModel = settings.model || '';
  for (const el of [els.system, els.temperature, els.topP, els.maxTokens]) el.addEventListener('change', saveSettings);
  els.model.addEventListener('change', () => { els.wantedModel = els.model.value; saveSettings(); });
  els.input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  els.stop.addEventListener('click', () => running && running.controller.abort());
  const composer = h('form', { class: 'composer', on: { submit: (e) => { e.preventDefault(); send(); } } },
    h('label', { for: 'chat-input', class: 'sr-only', text: 'Message' }),
    els.input,
    h('div', { class: 'composer-actions' }, els.status, els.stop, els.send));
  setChildren(root,
    h('div', { class: 'page-head' }, h('h1', { id: 'h-chat', text: 'Chat' })),
    h('div', { class: 'chat-layout' },
      h('aside', { class: 'chat-side card', 'aria-label': 'Conversations' },
        h('button', { class: 'btn btn-block', type: 'button', testid: 'chat-new', text: '+ New conversation', on: { click: newConversation } }),
        els.list),
      h('div', { class: 'chat-main card' }, els.messages, composer),
      h('aside', { class: 'chat-settings card', 'aria-label': 'Settings' },
        h('h2', { text: 'Settings' }),
        field('chat-model', 'Model', els.model, 'Models with an instance ready.'),
        field('chat-system', 'System prompt', els.system),
        h('div', { class: 'field-row' },
          field('chat-temperature', 'Temperature', els.temperature),
          field('chat-top-p', 'Top p', els.topP)),
        field('chat-max-tokens', 'Max tokens', els.maxTokens))));
  renderConversations();
  renderMessages();
  onSnapshot(renderModels);
}

function renderModels({ state }) {
  const ids = readyModels(state);
  const want = els.wantedModel || els.model.value;
  const same = [...els.model.options].map((o) => o.value).join('\n') === ids.join('\n');
  if (!same) {
    setChildren(els.model, ids.length
      ? ids.map((id) => h('option', { value: id, text: id }))
      : h('option', { value: '', text: 'No model ready: place one on the Models page' }));
  }
  if (ids.includes(want)) els.model.value = want;
  els.model.disabled = ids.length === 0;
}

function newConversation() {
  if (running) return;
  const conv = { id: crypto.randomUUID?.() || String(Date.now()), title: 'New conversation', created: Date.now(), messages: [] };
  store.conversations.unshift(conv);
  store.current = conv.id;
  saveStore();
  renderConversations();
  renderMessages();
  els.input.focus();
  return conv;
}

function renderConversations() {
  setChildren(els.list, store.conversations.map((c) => h('li', { class: c.id === store.current ? 'active' : '' },
    h('button', { class: 'conv-open', type: 'button', text: c.title, title: c.title,
      'aria-current': c.id === store.current ? 'true' : null,
      on: { click: () => { if (running) return; store.current = c.id; saveStore(); renderConversations(); renderMessages(); } } }),
    h('button', { class: 'btn-icon', type: 'button', 'aria-label': `Delete conversation ${c.title}`, title: 'Delete', text: '×',
      on: { click: () => deleteConversation(c.id) } }))));
  if (!store.conversations.length) els.list.append(h('li', { class: 'muted small empty', text: 'No conversations yet.' }));
}

function deleteConversation(id) {
  if (running && store.current === id) return;
  store.conversations = store.conversations.filter((c) => c.id !== id);
  if (store.current === id) store.current = store.conversations[0]?.id || null;
  saveStore();
  renderConversations();
  renderMessages();
}

function renderMessages() {
  const conv = current();
  if (!conv || !conv.messages.length) {
    setChildren(els.messages, h('div', { class: 'empty-chat' },
      h('p', { class: 'strong', text: 'Start a conversation' }),
      h('p', { class: 'muted small', text: 'Pick a ready model in Settings, then ask away. Answers stream as they are generated.' })));
    return;
  }
  setChildren(els.messages, conv.messages.map((m) => (m.role === 'user' ? userView(m) : answerView(m).el)));
  els.messages.scrollTop = els.messages.scrollHeight;
}

function userView(m) {
  return h('article', { class: 'msg msg-user', testid: 'chat-question' }, h('div', { class: 'msg-text', text: m.content }));
}

/** The element of one answer and the functions that update it as it streams. */
function answerView(m) {
  const thinkingText = h('div', { class: 'thinking-text' });
  const thinking = h('details', { class: 'thinking', testid: 'answer-thinking', hidden: !m.reasoning },
    h('summary', { text: 'Thinking' }), thinkingText);
  const prefill = h('progress', { testid: 'prefill-progress', max: 1, value: 0, hidden: true, 'aria-label': 'Reading the prompt' });
  const prefillLabel = h('span', { class: 'small muted', hidden: true });
  const text = h('div', { class: 'msg-text', testid: 'answer-text' });
  const tools = h('div', { class: 'tool-calls' });
  const status = h('div', { class: 'answer-status small', testid: 'answer-status' });
  const stats = h('div', { class: 'answer-stats small muted', testid: 'answer-stats' });
  const el = h('article', { class: 'msg msg-assistant', testid: 'chat-answer', 'data-state': m.status || 'done' },
    h('div', { class: 'msg-meta small muted', text: m.model || '' }), thinking, h('div', { class: 'prefill' }, prefill, prefillLabel),
    text, tools, status, stats);
  const view = {
    el,
    update() {
      if (text.textContent !== m.content) text.textContent = m.content;
      if (m.reasoning) { thinking.hidden = false; thinkingText.textContent = m.reasoning; }
      setChildren(tools, (m.toolCalls || []).map((t) => h('div', { class: 'tool-call' },
        h('span', { class: 'small muted', text: 'Tool call ' }),
        h('code', { text: `${t.name || '?'}(${t.arguments || ''})` }))));
    },
    prefill(processed, total) {
      prefill.hidden = false; prefillLabel.hidden = false;
      prefill.max = total || 1; prefill.value = processed;
      prefillLabel.textContent = `Reading the prompt: ${processed} of ${total} tokens`;
    },
    prefillDone() { prefill.hidden = true; prefillLabel.hidden = true; },
    finish() {
      view.prefillDone();
      el.dataset.state = m.status;
      status.className = `answer-status small ${m.status === 'stopped' ? 'warn-text' : ''}`;
      if (m.status === 'error') status.replaceChildren(errorBox(m.error || 'the answer failed'));
      else status.textContent = m.status === 'stopped' ? 'Stopped' : '';
      stats.textContent = statsText(m.stats);
    },
  };
  view.update();
  if (m.status && m.status !== 'streaming') view.finish();
  else el.dataset.state = 'streaming';
  return view;
}

function statsText(s) {
  if (!s) return '';
  const parts = [];
  if (s.ttftMs != null) parts.push(`TTFT ${Math.round(s.ttftMs)} ms`);
  if (s.tokensPerSecond != null) parts.push(`${s.tokensPerSecond.toFixed(1)} tokens/s`);
  if (s.completionTokens != null) parts.push(`${s.completionTokens} tokens`);
  if (s.promptTokens != null) parts.push(`prompt ${s.promptTokens}${s.cachedTokens ? ` (${s.cachedTokens} cached)` : ''}`);
  return parts.join(' · ');
}

/** The request's messages: the system prompt, then every finished turn. */
function history(conv, system) {
  const out = system ? [{ role: 'system', content: system }] : [];
  for (const m of conv.messages) {
    if (m.role === 'user') out.push({ role: 'user', content: m.content });
    else if (m.status !== 'error' && m.status !== 'streaming' && m.content) out.push({ role: 'assistant', content: m.content });
  }
  return out;
}

function numberOf(input) {
  const v = input.value.trim();
  return v === '' || Number.isNaN(Number(v)) ? undefined : Number(v);
}

async function send() {
  const question = els.input.value.trim();
  if (!question || running) return;
  const model = els.model.value;
  if (!model) { setChildren(els.status, errorBox('No model is ready: place one on the Models page first.')); return; }
  setChildren(els.status);
  const conv = current() || newConversation();
  const messages = history(conv, els.system.value.trim());
  messages.push({ role: 'user', content: question });
  conv.messages.push({ role: 'user', content: question });
  if (conv.title === 'New conversation') conv.title = question.slice(0, 60);
  const answer = { role: 'assistant', model, content: '', reasoning: '', toolCalls: [], status: 'streaming' };
  conv.messages.push(answer);
  els.input.value = '';
  saveStore();
  renderConversations();
  renderMessages();
  const view = answerView(answer);
  els.messages.lastElementChild.replaceWith(view.el);
  const body = { model, messages, stream: true, stream_options: { include_usage: true, include_progress: true } };
  const sampling = { temperature: numberOf(els.temperature), top_p: numberOf(els.topP), max_tokens: numberOf(els.maxTokens) };
  for (const [k, v] of Object.entries(sampling)) if (v !== undefined) body[k] = v;
  running = { controller: new AbortController() };
  els.send.disabled = true;
  els.stop.disabled = false;
  try {
    await stream(body, answer, view, running.controller.signal);
    answer.status = 'done';
  } catch (e) {
    if (e.name === 'AbortError') answer.status = 'stopped';
    else { answer.status = 'error'; answer.error = e.message; }
  } finally {
    running = null;
    els.send.disabled = false;
    els.stop.disabled = true;
    view.finish();
    saveStore();
  }
}

/** Streams one answer into `answer`, updating `view` as chunks come. */
async function stream(body, answer, view, signal) {
  const started = performance.now();
  let first = null;
  let last = null;
  let chunks = 0;
  let usage = null;
  let figures = null;
  const measure = () => {
    const tokens = usage?.completion_tokens ?? chunks;
    const decodeSeconds = first != null && last > first ? (last - first) / 1000 : 0;
    answer.stats = {
      ttftMs: first != null ? first - started : figures?.time_to_first_token_ms,
      serverTtftMs: figures?.time_to_first_token_ms,
      tokensPerSecond: figures?.decode_tokens_per_second ?? (decodeSeconds && tokens > 1 ? (tokens - 1) / decodeSeconds : undefined),
      completionTokens: tokens,
      promptTokens: usage?.prompt_tokens,
      cachedTokens: usage?.prompt_tokens_details?.cached_tokens,
    };
  };
  let response;
  try {
    response = await fetch(apiUrl('/v1/chat/completions'), {
      method: 'POST', headers: headers({ 'content-type': 'application/json' }), body: JSON.stringify(body), signal,
    });
  } catch (e) {
    if (e.name === 'AbortError') throw e;
    throw new Error(`cannot reach the node (${e.message})`);
  }
  if (!response.ok) throw await errorOf(response);
  try {
    for await (const data of sseData(response)) {
      if (data === '[DONE]') break;
      let chunk;
      try { chunk = JSON.parse(data); } catch { continue; }
      if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
      const progress = chunk.tessera?.prefill_progress;
      if (progress && first == null) view.prefill(progress.processed_tokens || 0, progress.total_tokens || 0);
      if (chunk.usage) usage = chunk.usage;
      if (chunk.tessera && chunk.tessera.time_to_first_token_ms != null) figures = chunk.tessera;
      for (const choice of chunk.choices || []) applyDelta(answer, choice.delta || {}, () => {
        const now = performance.now();
        if (first == null) { first = now; view.prefillDone(); }
        last = now;
        chunks += 1;
      });
      view.update();
    }
  } finally {
    measure();
  }
}

/** Adds a delta's content, thinking and tool calls; `tick` on each token. */
function applyDelta(answer, delta, tick) {
  if (delta.content) { answer.content += delta.content; tick(); }
  if (delta.reasoning_content) { answer.reasoning += delta.reasoning_content; tick(); }
  for (const call of delta.tool_calls || []) {
    const i = call.index ?? answer.toolCalls.length;
    const t = answer.toolCalls[i] || (answer.toolCalls[i] = { id: '', name: '', arguments: '' });
    if (call.id) t.id = call.id;
    if (call.function?.name) t.name += call.function.name;
    if (call.function?.arguments) t.arguments += call.function.arguments;
    tick();
  }
}
