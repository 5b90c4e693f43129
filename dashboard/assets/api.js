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

/** The readable message of a failed response: its JSON error.message. */
export async function errorOf(response) {
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
      headers: body === undefined ? {} : { 'content-type': 'application/json' },
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
 * A server-sent event stream that keeps coming back: EventSource retries a
 * dropped connection by itself, but gives up for good on an HTTP error (a
 * node restarting may answer one), so then we open a new one after a pause.
 * Handlers: onMessage(data), onOpen(), onError(willRetry).
 */
export function openStream(path, { onMessage, onOpen, onError }) {
  let source = null;
  let timer = null;
  let closed = false;
  const connect = () => {
    source = new EventSource(apiUrl(path));
    source.onopen = () => onOpen && onOpen();
    source.onmessage = (e) => onMessage(e.data);
    source.onerror = () => {
      if (onError) onError();
      if (source.readyState === EventSource.CLOSED && !closed) {
        clearTimeout(timer);
        timer = setTimeout(connect, 2000);
      }
    };
  };
  connect();
  return {
    close() {
      closed = true;
      clearTimeout(timer);
      if (source) source.close();
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
