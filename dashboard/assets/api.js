// The one way to the node: every call is prefixed with the API base (the
// page's own origin, or ?api=http://HOST:PORT while developing), and every
// error becomes an ApiError carrying the body's error.message.

const param = new URLSearchParams(location.search).get('api');
export const API_BASE = param && /^https?:\/\//.test(param) ? param.replace(/\/+$/, '') : '';

export function apiUrl(path) {
  return API_BASE + path;
}

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

// A node started with --api-key wants one on every call but the page's own
// files: the person gives it once (see app.js) and it is kept in this browser.
const KEY_STORE = 'tessera.apiKey';

export function apiKey() {
  try { return localStorage.getItem(KEY_STORE) || ''; } catch { return ''; }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
  } catch { /* storage disabled: the key lasts until reload */ }
}

/** Headers for a call: `extra` plus the API key when one is set. */
export function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, authorization: `Bearer ${key}` } : extra;
}

const authListeners = new Set();

/** fn(true) when the node refused for want of a key, fn(false) once one works. */
export function onAuthNeeded(fn) {
  authListeners.add(fn);
}

function authState(needed) {
  for (const fn of authListeners) fn(needed);
}

/** The readable message of a failed response: its JSON error.message. */
export async function errorOf(response) {
  if (response.status === 401) authState(true);
  let text = '';
  try { text = await response.text(); } catch { /* body lost */ }
  try {
    const body = JSON.parse(text);
    const message = body?.error?.message ?? (typeof body?.error === 'string' ? body.error : null);
    if (message) return new ApiError(message, response.status);
  } catch { /* not JSON */ }
  return new ApiError(text.trim() || `HTTP ${response.status} ${response.statusText}`, response.status);
}

export async function request(method, path, body) {
  let response;
  try {
    response = await fetch(apiUrl(path), {
      method,
      headers: headers(body === undefined ? {} : { 'content-type': 'application/json' }),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    throw new ApiError(`cannot reach the node (${e.message})`, 0);
  }
  if (!response.ok) throw await errorOf(response);
  const text = await response.text();
  return text ? JSON.parse(text) : null;
}

export const getJson = (path) => request('GET', path);
export const postJson = (path, body) => request('POST', path, body ?? {});
export const deleteJson = (path) => request('DELETE', path);

/**
 * A server-sent event stream that keeps coming back. Read with fetch rather
 * than EventSource, which cannot send the API key header; a dropped or
 * refused connection is opened again after a pause (the node may be
 * restarting). `path` may be a function, asked again on each reconnect (the
 * event log goes on from where it stopped). Handlers: onMessage(data),
 * onOpen(), onError(error).
 */
export function openStream(path, { onMessage, onOpen, onError }) {
  let controller = null;
  let timer = null;
  let closed = false;
  const connect = async () => {
    controller = new AbortController();
    try {
      const url = apiUrl(typeof path === 'function' ? path() : path);
      const response = await fetch(url, { headers: headers({ accept: 'text/event-stream' }), signal: controller.signal, cache: 'no-store' });
      if (!response.ok) throw await errorOf(response);
      authState(false);
      if (onOpen) onOpen();
      for await (const data of sseData(response)) onMessage(data);
      throw new Error('the node closed the stream');
    } catch (e) {
      if (closed) return;
      if (onError) onError(e);
      timer = setTimeout(connect, 2000);
    }
  };
  connect();
  return {
    close() {
      closed = true;
      clearTimeout(timer);
      if (controller) controller.abort();
    },
  };
}

/**
 * The `data:` payloads of a fetch response body in SSE form, as they come
 * (a ReadableStream read chunk by chunk; a line may span two chunks).
 */
export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    let nl;
    while ((nl = buffer.indexOf('\n')) >= 0) {
      const line = buffer.slice(0, nl).replace(/\r$/, '');
      buffer = buffer.slice(nl + 1);
      if (line.startsWith('data:')) yield line.slice(5).trimStart();
    }
    if (done) break;
  }
  if (buffer.startsWith('data:')) yield buffer.slice(5).trimStart();
}
