// Plots as plain SVG drawn here: a line plot (loss, accuracy) and stacked bars (requests and fallbacks).

import { fill, num, svgEl } from "./dom.js";

const W = 560;
const H = 180;
const PAD = { left: 48, right: 12, top: 12, bottom: 28 };

function scale(lo, hi, from, to) {
  const span = hi - lo || 1;
  return (v) => from + ((v - lo) / span) * (to - from);
}

/**
 * Draw `points` ([{x, y}], any order) into `svg` as a line with a dot per point. The svg's data-points attribute
 * holds the number of points drawn (the tests watch it grow while a job trains).
 */
export function linePlot(svg, points, { title, xLabel = "", yLabel = "", yMin, yMax, xFormat = (x) => num(x, 0) } = {}) {
  const pts = points.filter((p) => Number.isFinite(p.x) && Number.isFinite(p.y)).sort((a, b) => a.x - b.x);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("data-points", String(pts.length));
  const kids = [svgEl("title", { text: title || yLabel })];
  const x0 = PAD.left;
  const x1 = W - PAD.right;
  const y0 = H - PAD.bottom;
  const y1 = PAD.top;
  kids.push(svgEl("rect", { class: "frame", x: x0, y: y1, width: x1 - x0, height: y0 - y1 }));
  if (!pts.length) {
    kids.push(svgEl("text", { class: "empty", x: (x0 + x1) / 2, y: (y0 + y1) / 2, "text-anchor": "middle" }, "no points yet"));
    fill(svg, kids);
    return;
  }
  const xs = pts.map((p) => p.x);
  const ys = pts.map((p) => p.y);
  const lo = yMin ?? Math.min(...ys);
  const hi = yMax ?? Math.max(...ys);
  const sx = scale(Math.min(...xs), Math.max(...xs), x0 + 6, x1 - 6);
  const sy = scale(lo, hi === lo ? lo + 1 : hi, y0 - 4, y1 + 4);
  kids.push(svgEl("polyline", { class: "line", points: pts.map((p) => `${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join(" ") }));
  for (const p of pts) {
    kids.push(svgEl("circle", { class: "pt", cx: sx(p.x).toFixed(1), cy: sy(p.y).toFixed(1), r: 3 }, svgEl("title", { text: `${xFormat(p.x)}: ${num(p.y)}` })));
  }
  kids.push(
    svgEl("text", { class: "tick", x: x0 - 6, y: y1 + 10, "text-anchor": "end" }, num(hi, 2)),
    svgEl("text", { class: "tick", x: x0 - 6, y: y0, "text-anchor": "end" }, num(lo, 2)),
    svgEl("text", { class: "tick", x: x0 + 6, y: H - 8 }, xFormat(Math.min(...xs))),
    svgEl("text", { class: "tick", x: x1 - 6, y: H - 8, "text-anchor": "end" }, xFormat(Math.max(...xs))),
    svgEl("text", { class: "axis", x: (x0 + x1) / 2, y: H - 8, "text-anchor": "middle" }, xLabel),
    svgEl("text", { class: "axis", x: 12, y: (y0 + y1) / 2, "text-anchor": "middle", transform: `rotate(-90 12 ${(y0 + y1) / 2})` }, yLabel),
  );
  fill(svg, kids);
}

/** Stacked bars: per bucket, requests served by a skill (below) and fallbacks to the base model (on top). */
export function barPlot(svg, buckets, { title = "requests", label = (b) => String(b.start) } = {}) {
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("data-bars", String(buckets.length));
  const kids = [svgEl("title", { text: title })];
  const x0 = PAD.left;
  const x1 = W - PAD.right;
  const y0 = H - PAD.bottom;
  const y1 = PAD.top;
  kids.push(svgEl("rect", { class: "frame", x: x0, y: y1, width: x1 - x0, height: y0 - y1 }));
  const top = Math.max(1, ...buckets.map((b) => b.requests || 0));
  const step = (x1 - x0) / Math.max(1, buckets.length);
  buckets.forEach((b, i) => {
    const fallbacks = Math.min(b.fallbacks || 0, b.requests || 0);
    const served = (b.requests || 0) - fallbacks;
    const hServed = ((y0 - y1) * served) / top;
    const hFall = ((y0 - y1) * fallbacks) / top;
    const x = x0 + i * step + 2;
    const w = Math.max(1, step - 4);
    const tip = svgEl("title", { text: `${label(b)}: ${b.requests || 0} requests, ${fallbacks} fallbacks` });
    kids.push(svgEl("rect", { class: "bar served", x, y: y0 - hServed, width: w, height: hServed }, tip));
    if (fallbacks) kids.push(svgEl("rect", { class: "bar fallback", x, y: y0 - hServed - hFall, width: w, height: hFall }));
  });
  kids.push(svgEl("text", { class: "tick", x: x0 - 6, y: y1 + 10, "text-anchor": "end" }, String(top)));
  kids.push(svgEl("text", { class: "tick", x: x0 - 6, y: y0, "text-anchor": "end" }, "0"));
  fill(svg, kids);
}
