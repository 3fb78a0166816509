// Routing: live routing accuracy from the probes (and labelled traffic) as a plot, each skill's share and the
// fallbacks over a window, the confusion between skills, and, for the admin only, the fallback clusters: the
// skills the pool is missing.

import { optional } from "./api.js";
import { el, fill, num, percent, problem, svgEl, when } from "./dom.js";
import { barPlot, linePlot } from "./plot.js";

const WINDOWS = [
  [3600, "last hour"],
  [6 * 3600, "last 6 hours"],
  [86400, "last 24 hours"],
];
let root;
let windowPick;
let last = 0;

export function init(section) {
  root = section;
  windowPick = el("select", { id: "routing-window" }, WINDOWS.map(([s, label]) => el("option", { value: s, text: label })));
}

export async function show(ctx) {
  last = Date.now();
  try {
    await render(ctx);
  } catch (e) {
    fill(root, el("h2", { text: "Routing" }), problem(e));
  }
}

export function tick(ctx) {
  if (Date.now() - last > 10000) show(ctx);
}

const unavailable = (what) => el("p", { class: "muted", text: `${what}: not available on this server.` });

async function render(ctx) {
  const win = Number(windowPick.value);
  const [accuracy, usage, confusion, clusters] = await Promise.all([
    optional("/v1/skillpool/routing/accuracy"),
    optional(`/v1/skillpool/routing?window=${win}`),
    optional("/v1/skillpool/routing/confusion"),
    ctx.who.can.fallback_clusters ? optional("/v1/skillpool/fallback_clusters") : Promise.resolve(undefined),
  ]);
  windowPick.onchange = () => show(ctx);
  fill(
    root,
    el("h2", { text: "Routing" }),
    el("section", { "aria-labelledby": "routing-accuracy" }, el("h3", { id: "routing-accuracy", text: "Routing accuracy" }), accuracy ? accuracyView(accuracy) : unavailable("Routing accuracy")),
    el(
      "section",
      { "aria-labelledby": "routing-share" },
      el("h3", { id: "routing-share", text: "Routing share and fallbacks" }),
      el("div", { class: "field" }, el("label", { for: windowPick.id, text: "Window" }), windowPick),
      usage ? shareView(usage) : unavailable("Routing share"),
    ),
    el("section", { "aria-labelledby": "routing-confusion" }, el("h3", { id: "routing-confusion", text: "Confusion between skills (probe prompts)" }), confusion ? confusionView(confusion) : unavailable("Confusion")),
    clusters === undefined ? null : clustersView(clusters),
  );
}

function accuracyView(a) {
  const plot = svgEl("svg", { class: "plot", "data-testid": "accuracy-plot", "aria-label": "Mean routing accuracy over time" });
  linePlot(plot, (a.history || []).map((h) => ({ x: h.t, y: h.mean })), {
    title: "Mean routing accuracy on the probe prompts, each time it was measured",
    xLabel: "time",
    yLabel: "accuracy",
    yMin: 0,
    yMax: 1,
    xFormat: (t) => new Date(t * 1000).toLocaleTimeString(),
  });
  const skills = Object.entries(a.skills || {});
  const labelled = a.labelled;
  return el(
    "div",
    {},
    el("p", { "data-testid": "accuracy-mean", text: `Mean over the skills' probe prompts: ${a.mean === null || a.mean === undefined ? "–" : percent(a.mean, 1)}` }),
    plot,
    skills.length ? el("ul", { class: "inline" }, skills.map(([s, v]) => el("li", { text: `${s}: ${percent(v, 1)}` }))) : null,
    el("p", {
      class: "muted",
      text: labelled
        ? `Labelled traffic: ${labelled.correct} of ${labelled.requests} requests routed to the skill the client expected (${percent(labelled.requests ? labelled.correct / labelled.requests : null, 1)}).`
        : "Labelled traffic: none (clients may name the skill they expect with metadata.expected_skill).",
    }),
  );
}

function shareView(u) {
  const bars = svgEl("svg", { class: "plot", "data-testid": "routing-bars", "aria-label": "Requests and fallbacks over the window" });
  barPlot(bars, u.buckets || [], { title: "Requests per bucket: served by a skill (below) and fallbacks (on top)", label: (b) => when(b.start) });
  return el(
    "div",
    {},
    el("p", { text: `${u.requests} routed requests; ${u.fallbacks} fell back to the base model (${percent(u.fallback_share, 1)}).` }),
    bars,
    el(
      "table",
      { class: "grid", "data-testid": "routing-share-table" },
      el("thead", {}, el("tr", {}, ["Skill", "Requests", "Share"].map((h) => el("th", { scope: "col", text: h })))),
      el("tbody", {}, (u.skills || []).map((s) => el("tr", {}, el("th", { scope: "row", text: s.skill }), el("td", { class: "num", text: String(s.requests) }), el("td", { class: "num", text: percent(s.share, 1) })))),
    ),
  );
}

function confusionView(c) {
  const labels = c.labels || [];
  if (!labels.length || !(c.matrix || []).length) return el("p", { class: "muted", text: "No probe prompts yet: the pool has no skill." });
  return el(
    "div",
    { class: "scroll" },
    el(
      "table",
      { class: "grid confusion", "data-testid": "confusion-table" },
      el("caption", { text: "Rows: the skill whose probe prompt it was; columns: where the router sent it (base: fallback)." }),
      el("thead", {}, el("tr", {}, el("th", { scope: "col", text: "probe of \\ routed to" }), labels.map((l) => el("th", { scope: "col", text: l })))),
      el(
        "tbody",
        {},
        c.matrix.map((row, i) =>
          el("tr", {}, el("th", { scope: "row", text: labels[i] ?? "" }), row.map((n, j) => el("td", { class: `num${labels[i] === labels[j] ? " diagonal" : ""}`, text: String(n) }))),
        ),
      ),
    ),
  );
}

function clustersView(clusters) {
  const heading = el("h3", { id: "fallback-clusters", text: "Fallback clusters: the skills the pool is missing" });
  if (clusters === null) return el("section", { "data-testid": "fallback-clusters" }, heading, unavailable("Fallback clusters"));
  const rows = clusters.data || [];
  return el(
    "section",
    { "aria-labelledby": "fallback-clusters", "data-testid": "fallback-clusters" },
    heading,
    el("p", { class: "muted", text: `${clusters.observed ?? 0} fallback requests observed; clusters heaviest first (size decays with time).` }),
    rows.length
      ? el(
          "table",
          { class: "grid" },
          el("thead", {}, el("tr", {}, ["Size", "Requests", "Last seen", "Examples", "Nearest skills"].map((h) => el("th", { scope: "col", text: h })))),
          el(
            "tbody",
            {},
            rows.map((r) =>
              el(
                "tr",
                { "data-testid": "cluster-row" },
                el("td", { class: "num", text: num(r.size, 1) }),
                el("td", { class: "num", text: String(r.count) }),
                el("td", { text: when(r.last_seen) }),
                el("td", {}, el("ul", { class: "examples" }, (r.examples || []).map((x) => el("li", { text: x })))),
                el("td", { text: (r.nearest_skills || []).map((s) => `${s.skill} ${num(s.weight, 2)}`).join(", ") || "–" }),
              ),
            ),
          ),
        )
      : el("p", { class: "muted", text: "No fallback clusters: every recent request found a skill, or too few fell back." }),
  );
}
