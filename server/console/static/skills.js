// Skills: every served skill with its versions, method, training rows, quality-gate numbers and routing share,
// the pool's fallbacks over the last hour, and the actions the key's role allows.

import { api, optional, path } from "./api.js";
import { el, fill, num, percent, problem, signed, svgEl, when } from "./dom.js";
import { barPlot } from "./plot.js";

const HOUR = 3600;
let root;
let last = 0;
let armed = null; // the skill whose Retire button was pressed once: a second press retires it

export function init(section) {
  root = section;
}

export async function show(ctx) {
  last = Date.now();
  if (!root.firstChild) fill(root, el("h2", { text: "Skills" }), el("p", { class: "muted", text: "Loading…" }));
  try {
    await render(ctx);
  } catch (e) {
    fill(root, el("h2", { text: "Skills" }), problem(e));
  }
}

export function tick(ctx) {
  if (Date.now() - last > 15000) show(ctx);
}

function trainingRows(version, detail) {
  const t = version?.training || {};
  const rows = t.rows ?? t.examples ?? t.train_rows ?? version?.samples?.train ?? detail?.samples?.train;
  return typeof rows === "number" ? String(rows) : "–";
}

function routingShare(usage, known) {
  if (!known) return "–"; // this server keeps no routing counts
  return usage ? `${percent(usage.share)} (${usage.requests})` : "0% (0)";
}

function earlierChange(quality) {
  const earlier = quality?.earlier || {};
  const names = Object.keys(earlier);
  if (!names.length) return "none to re-check";
  return names.map((n) => `${n} ${signed(-(earlier[n].drop ?? 0))}`).join(", ");
}

function verdict(quality) {
  if (!quality) return "–";
  if (quality.passed) return "passed";
  return quality.forced ? "failed (forced)" : "failed";
}

async function render(ctx) {
  const [models, usage] = await Promise.all([api("/v1/models"), optional(`/v1/skillpool/routing?window=${HOUR}`).catch(() => null)]);
  const listed = (models?.data || []).filter((m) => m.skill);
  const details = await Promise.all(listed.map((m) => api(`/v1/models/${path(m.id)}`).catch(() => m)));
  const share = new Map((usage?.skills || []).map((s) => [s.skill, s]));

  const summary = usage
    ? `Last hour: ${usage.requests} routed requests; ${usage.fallbacks} fell back to the base model (${percent(usage.fallback_share)}).`
    : "Routing share and fallbacks: not available on this server.";
  const bars = svgEl("svg", { class: "plot", "data-testid": "fallback-bars", "aria-label": "Requests and fallbacks over the last hour" });
  if (usage) barPlot(bars, usage.buckets || [], { title: "Requests (skills below, fallbacks on top) over the last hour", label: (b) => when(b.start) });

  const head = [
    "Skill", "Version", "Method", "Training rows", "Metric", "Skill score", "Base model", "Most frequent answer",
    "Gate", "Earlier skills' change", "Routing share (1 h)", "Actions",
  ];
  const table = el(
    "table",
    { class: "grid", "data-testid": "skills-table" },
    el("caption", { text: `${listed.length} skill(s) in the pool` }),
    el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col", text: h })))),
    el("tbody", {}, details.map((d) => row(ctx, d, share.get(d.skill), Boolean(usage)))),
  );
  fill(
    root,
    el("h2", { text: "Skills" }),
    el("p", { "data-testid": "fallback-summary", text: summary }),
    usage ? bars : null,
    listed.length ? el("div", { class: "scroll" }, table) : el("p", { class: "muted", text: "No skills yet: upload a dataset to teach the pool one." }),
    el("p", { class: "muted" }, el("button", { type: "button", onclick: () => show(ctx), text: "Refresh" })),
  );
}

function row(ctx, d, usage, known) {
  const versions = d.versions || [];
  const serving = versions.find((v) => v.serving) || versions[versions.length - 1] || d;
  const q = d.quality || null;
  const gate = q?.new || serving?.eval || d.eval || {};
  const cell = (id, text, cls) => el("td", { "data-testid": id, class: cls, text });
  return el(
    "tr",
    { "data-testid": "skill-row", "data-skill": d.skill },
    el("th", { scope: "row", "data-testid": "skill-name", text: d.id !== d.skill ? `${d.skill} (${d.id})` : d.skill }),
    cell("skill-version", `v${d.version} of ${versions.length || 1}`),
    cell("skill-method", serving?.training?.method || d.method || "–"),
    cell("skill-rows", trainingRows(serving, d), "num"),
    cell("gate-metric", gate.metric ? `${gate.metric} (n=${gate.n ?? "–"})` : "–"),
    cell("gate-score", num(gate.score), "num"),
    cell("gate-base", num(gate.base_score), "num"),
    cell("gate-trivial", num(gate.trivial_score), "num"),
    cell("gate-verdict", verdict(q)),
    cell("gate-earlier", earlierChange(q)),
    cell("routing-share", routingShare(usage, known), "num"),
    el("td", { "data-testid": "skill-actions" }, actions(ctx, d, versions)),
  );
}

function actions(ctx, d, versions) {
  const out = [];
  const name = d.skill;
  if (ctx.who.can.retire) {
    const retire = el("button", {
      type: "button",
      class: "danger",
      "aria-label": `Retire ${name}`,
      text: armed === name ? "Press again to retire" : "Retire",
    });
    retire.addEventListener("click", () => act(ctx, retire, name, () => api(`/v1/models/${path(d.id)}`, { method: "DELETE" })));
    out.push(retire);
  }
  const others = versions.filter((v) => !v.serving);
  if (ctx.who.can.rollback && others.length) {
    const pick = el("select", { "aria-label": `Version of ${name} to serve` }, others.map((v) => el("option", { value: v.version, text: `v${v.version}` })));
    const go = el("button", { type: "button", "aria-label": `Roll back ${name}`, text: "Roll back" });
    go.addEventListener("click", async () => {
      go.disabled = true;
      try {
        await api(`/v1/models/${path(d.id)}/rollback`, { method: "POST", json: { version: Number(pick.value) } });
        show(ctx);
      } catch (e) {
        go.after(problem(e));
        go.disabled = false;
      }
    });
    out.push(pick, go);
  }
  // the admin, or the train key that created the skill (the model's owner), may train a new version
  if (ctx.who.role === "admin" || (ctx.who.can.train && d.owner && d.owner === ctx.who.name)) {
    out.push(el("button", { type: "button", "aria-label": `New version of ${name}`, text: "New version", onclick: () => ctx.go("upload", { name, newVersion: true }) }));
  }
  return out.length ? out : el("span", { class: "muted", text: "–" });
}

async function act(ctx, button, name, call) {
  if (armed !== name) {
    armed = name;
    button.textContent = "Press again to retire";
    setTimeout(() => {
      if (armed === name) armed = null;
    }, 5000);
    return;
  }
  armed = null;
  button.disabled = true;
  try {
    await call();
    show(ctx);
  } catch (e) {
    button.after(problem(e));
    button.disabled = false;
  }
}
