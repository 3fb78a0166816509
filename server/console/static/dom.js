// DOM helpers. Every string from the server goes in as a text node: nothing here parses HTML.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** An HTML element: el("td", {class: "num"}, "0.812"). */
export function el(tag, attrs = {}, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element, for the plots. */
export function svgEl(tag, attrs = {}, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

/** Replace a node's children. */
export function fill(node, ...children) {
  node.replaceChildren();
  return build(node, {}, children);
}

export function num(x, digits = 3) {
  return typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "–";
}

export function signed(x, digits = 3) {
  if (typeof x !== "number" || !Number.isFinite(x)) return "–";
  return (x > 0 ? "+" : x < 0 ? "−" : "±") + Math.abs(x).toFixed(digits);
}

export function percent(x, digits = 0) {
  return typeof x === "number" && Number.isFinite(x) ? `${(100 * x).toFixed(digits)}%` : "–";
}

export function when(unixSeconds) {
  if (!unixSeconds) return "–";
  return new Date(unixSeconds * 1000).toLocaleString();
}

export function duration(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return "–";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

/** A message line for an error: the API's own message, or "not available" for an endpoint this server lacks. */
export function problem(error) {
  return el("p", { class: "problem", role: "alert" }, error?.message || String(error));
}
