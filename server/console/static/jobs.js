// Jobs: queued, running and ended training jobs; the one followed shows live progress, its loss curve (updated
// while it trains), and once ended its events, checkpoints and quality-gate report; cancel.

import { api, optional, path } from "./api.js";
import { duration, el, fill, num, problem, signed, svgEl, when } from "./dom.js";
import { linePlot } from "./plot.js";

const ENDED = new Set(["succeeded", "failed", "cancelled"]);
let root;
let list;
let detail;
let followed = null; // the id of the job shown in detail
let job = null;
let lastList = 0;
let busy = false;
const losses = new Map(); // job id -> Map(step -> loss): the events' points plus every live reading seen

export function init(section) {
  root = section;
  list = el("div", { "data-testid": "jobs-list" });
  detail = el("div", { class: "detail", "data-testid": "job-detail" });
  fill(root, el("h2", { text: "Jobs" }), list, detail);
}

export async function show(ctx, arg) {
  if (arg?.follow) followed = arg.follow;
  await refresh(ctx, true);
}

export function hide() {}

export async function tick(ctx) {
  const live = followed && !(job && ENDED.has(job.status));
  if (live || Date.now() - lastList > 4000) await refresh(ctx, Date.now() - lastList > 4000);
}

async function refresh(ctx, withList) {
  if (busy) return;
  busy = true;
  try {
    if (withList) {
      lastList = Date.now();
      try {
        renderList(ctx, (await api("/tasks")).data || []);
      } catch (e) {
        fill(list, problem(e));
      }
    }
    if (followed) {
      try {
        const ended = job?.id === followed && ENDED.has(job.status);
        const before = job?.id === followed ? job.status : null;
        if (!ended || withList) job = await api(`/tasks/${path(followed)}`);
        if (before !== null && before !== job.status) lastList = 0; // the list shows the new status on the next tick
        await renderDetail(ctx, job);
      } catch (e) {
        fill(detail, problem(e));
      }
    }
  } finally {
    busy = false;
  }
}

function progressText(j) {
  const p = j.progress || {};
  if (j.status === "queued" || j.status === "validating_files") return j.status === "queued" ? "waiting for the trainer" : "validating the file";
  if (!p.total) return j.status === "running" ? "starting" : "–";
  const parts = [`step ${p.step} of ${p.total}`];
  if (j.status === "running") {
    if (p.tokens_per_s) parts.push(`${Math.round(p.tokens_per_s)} tokens/s`);
    if (p.eta_s !== null && p.eta_s !== undefined) parts.push(`ETA ${duration(p.eta_s)}`);
  }
  if (p.loss !== null && p.loss !== undefined) parts.push(`loss ${num(p.loss)}`);
  return parts.join(" · ");
}

function renderList(ctx, jobs) {
  const head = ["Job", "Skill", "Method", "Status", "Progress", "Created", "Error", ""];
  fill(
    list,
    jobs.length
      ? el(
          "div",
          { class: "scroll" },
          el(
            "table",
            { class: "grid", "data-testid": "jobs-table" },
            el("caption", { text: `${jobs.length} job(s), newest first` }),
            el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col", text: h })))),
            el(
              "tbody",
              {},
              jobs.map((j) =>
                el(
                  "tr",
                  { "data-testid": "job-row", "data-job": j.id, class: j.id === followed ? "selected" : null },
                  el("th", { scope: "row", text: j.id }),
                  el("td", { text: j.skill }),
                  el("td", { text: j.method }),
                  el("td", { class: `status ${j.status}`, text: j.status }),
                  el("td", { text: progressText(j) }),
                  el("td", { text: when(j.created_at) }),
                  el("td", { class: "error-text", "data-testid": "job-row-error", text: j.error || "" }),
                  el("td", {}, el("button", { type: "button", "aria-label": `Open job ${j.id}`, text: "Open", onclick: () => show(ctx, { follow: j.id }) })),
                ),
              ),
            ),
          ),
        )
      : el("p", { class: "muted", text: "No jobs yet." }),
  );
}

function lossPoints(j) {
  let points = losses.get(j.id);
  if (!points) losses.set(j.id, (points = new Map()));
  for (const e of j.events || []) {
    const d = e.data || {};
    if (e.type === "metrics" && Number.isFinite(d.step) && Number.isFinite(d.train_loss)) points.set(d.step, d.train_loss);
  }
  const p = j.progress || {};
  if (Number.isFinite(p.step) && Number.isFinite(p.loss) && p.step > 0) points.set(p.step, p.loss);
  return [...points].map(([x, y]) => ({ x, y }));
}

function gateReport(j) {
  const withGate = [...(j.events || [])].reverse().find((e) => e.data?.quality);
  const report = withGate?.data?.quality || (j.eval?.new ? j.eval : j.eval ? { new: j.eval } : null);
  if (!report) return null;
  const n = report.new || {};
  const rows = [
    ["Metric", `${n.metric ?? "–"} on ${n.n ?? "–"} held-out rows`],
    ["Skill score", num(n.score)],
    ["Base model", num(n.base_score)],
    ["Most frequent answer", num(n.trivial_score)],
    ["Bar to pass", num(n.bar)],
    ["Gain's lower bound", num(n.gain_lower_bound)],
    ["Verdict", report.passed === undefined ? "–" : report.passed ? "passed" : report.forced ? "failed (forced)" : "failed"],
  ];
  for (const [skill, r] of Object.entries(report.earlier || {})) rows.push([`Earlier skill ${skill}`, `${num(r.before)} → ${num(r.after)} (${signed(-(r.drop ?? 0))}) on ${r.n} probes`]);
  return el(
    "div",
    { "data-testid": "gate-report" },
    el("h4", { text: "Quality gate" }),
    el("table", { class: "kv" }, el("tbody", {}, rows.map(([k, v]) => el("tr", {}, el("th", { scope: "row", text: k }), el("td", { text: v }))))),
    (report.reasons || []).length ? el("ul", { class: "reasons" }, report.reasons.map((r) => el("li", { text: r }))) : null,
  );
}

async function renderDetail(ctx, j) {
  const ended = ENDED.has(j.status);
  const plot = svgEl("svg", { class: "plot", "data-testid": "loss-plot", "aria-label": `Training loss of ${j.skill}` });
  linePlot(plot, lossPoints(j), { title: `Training loss of ${j.skill} by step`, xLabel: "step", yLabel: "loss" });
  const checkpoints = ended && j.status === "succeeded" ? await optional(`/v1/fine_tuning/jobs/${path(j.id)}/checkpoints`).catch(() => null) : null;
  const cancel =
    !ended && ctx.who.can.train
      ? el("button", {
          type: "button",
          class: "danger",
          text: "Cancel job",
          onclick: async (ev) => {
            ev.target.disabled = true;
            try {
              await api(`/tasks/${path(j.id)}`, { method: "DELETE" });
            } catch (e) {
              ev.target.after(problem(e));
            }
          },
        })
      : null;
  detail.dataset.job = j.id;
  fill(
    detail,
    el("h3", { text: `Job ${j.id}: skill ${j.skill}` }),
    el("p", {}, "Status: ", el("strong", { "data-testid": "job-status", text: j.status }), ` · method ${j.method} · ${j.examples || 0} rows · created ${when(j.created_at)}`),
    el("p", { "data-testid": "job-progress", text: progressText(j) }),
    j.error ? el("p", { class: "problem", "data-testid": "job-error", text: `Error: ${j.error}` }) : null,
    cancel,
    plot,
    ended ? gateReport(j) : null,
    checkpoints?.data?.length
      ? el("div", {}, el("h4", { text: "Checkpoints" }), el("ul", {}, checkpoints.data.map((c) => el("li", { text: `${c.fine_tuned_model_checkpoint} at step ${c.step_number}, loss ${num(c.metrics?.train_loss)}` }))))
      : null,
    el("h4", { text: "Events" }),
    el(
      "ol",
      { class: "events", "data-testid": "job-events", reversed: true },
      [...(j.events || [])].reverse().map((e) => el("li", { class: `level-${e.level}` }, el("time", { text: when(e.created_at) }), " ", e.message)),
    ),
  );
}
