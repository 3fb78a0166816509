// The JSON APIs, called with the key this tab holds (sessionStorage: gone when the tab closes).

const KEY = "skillpool.console.key";

export function getKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(status, body, fallback) {
    const err = body && typeof body === "object" ? body.error : null;
    const missing = status === 404 && (!err || err.code === "not_found"); // no such endpoint on this server
    super(missing ? "not available on this server" : err?.message || fallback || `HTTP ${status}`);
    this.status = status;
    this.code = err?.code || null;
    this.param = err?.param || null;
    this.errors = Array.isArray(err?.errors) ? err.errors : Array.isArray(body?.errors) ? body.errors : [];
    this.missing = missing;
  }
}

export function authHeaders(extra = {}) {
  const key = getKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

/** fetch with the key; the raw Response (the playground reads headers and streams). */
export function request(path, { method = "GET", json, form, signal } = {}) {
  const init = { method, headers: authHeaders(), signal, cache: "no-store" };
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (form !== undefined) {
    init.body = form;
  }
  return fetch(path, init);
}

/** The parsed JSON of a call; an ApiError (with the API's message, code, param and bad lines) when it fails. */
export async function api(path, options = {}) {
  const res = await request(path, options);
  const text = await res.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!res.ok) throw new ApiError(res.status, body, res.statusText);
  return body;
}

/** The value of a call, or null when this server does not have the endpoint. */
export async function optional(path) {
  try {
    return await api(path);
  } catch (e) {
    if (e instanceof ApiError && e.missing) return null;
    throw e;
  }
}

export const path = (...parts) => parts.map((p) => encodeURIComponent(p)).join("/");
