// Upload: a dataset file (drag and drop or the file input), the skill's name, method and config. A bad file shows
// every bad line with its number and reason, as the API returns them; an accepted one opens its job.

import { api } from "./api.js";
import { el, fill } from "./dom.js";

const METHODS = ["isolated", "kif", "sapt"];
let root;
let form;
let file = null;
let fields = {};

export function init(section, ctx) {
  root = section;
  if (!ctx.who.can.train) {
    fill(root, el("h2", { text: "Upload" }), el("p", { class: "muted", text: `A ${ctx.who.role} key may not upload datasets: training needs a train or admin key.` }));
    return;
  }
  fields = {
    file: el("input", { id: "upload-file", type: "file", accept: ".jsonl,.json,application/jsonl,application/json,text/plain" }),
    name: el("input", { id: "upload-name", type: "text", required: true, spellcheck: "false" }),
    method: el("select", { id: "upload-method" }, METHODS.map((m) => el("option", { value: m, text: m }))),
    config: el("textarea", { id: "upload-config", rows: 3, spellcheck: "false", placeholder: '{"epochs": 3}' }),
    newVersion: el("input", { id: "upload-new-version", type: "checkbox" }),
    force: ctx.who.role === "admin" ? el("input", { id: "upload-force", type: "checkbox" }) : null,
    chosen: el("p", { class: "muted", "data-testid": "upload-file-name", text: "No file chosen." }),
    result: el("div", { "data-testid": "upload-result", "aria-live": "polite" }),
    submit: el("button", { type: "submit", text: "Upload and train" }),
  };
  const drop = el(
    "div",
    { class: "drop", tabindex: 0, role: "button", "data-testid": "drop-zone", "aria-label": "Drop a dataset file here, or press to choose one" },
    el("strong", { text: "Drop a JSONL dataset here" }),
    " or press to choose one",
  );
  drop.addEventListener("click", () => fields.file.click());
  drop.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" || ev.key === " ") {
      ev.preventDefault();
      fields.file.click();
    }
  });
  drop.addEventListener("dragover", (ev) => {
    ev.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (ev) => {
    ev.preventDefault();
    drop.classList.remove("over");
    if (ev.dataTransfer?.files?.length) choose(ev.dataTransfer.files[0]);
  });
  fields.file.addEventListener("change", () => choose(fields.file.files[0] || null));
  const row = (label, input, hint) => el("div", { class: "field" }, el("label", { for: input.id, text: label }), input, hint ? el("small", { class: "muted", text: hint }) : null);
  form = el(
    "form",
    { class: "upload", "aria-label": "Upload a dataset" },
    drop,
    row("Dataset file (JSONL)", fields.file),
    fields.chosen,
    row("Skill name", fields.name, "letters, digits, '.', '_' or '-'"),
    row("Method", fields.method),
    row("Config (JSON)", fields.config, "training settings, e.g. epochs, batch_size, learning_rate"),
    el("div", { class: "field check" }, fields.newVersion, el("label", { for: fields.newVersion.id, text: "New version of an existing skill" })),
    fields.force ? el("div", { class: "field check" }, fields.force, el("label", { for: fields.force.id, text: "Force: keep the skill even if the quality gate fails (admin)" })) : null,
    fields.submit,
  );
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    send(ctx);
  });
  fill(root, el("h2", { text: "Upload" }), el("p", { class: "muted", text: "One example per line: {\"messages\": [...]} or {\"instruction\", \"input\", \"output\"}." }), form, fields.result);
}

export function show(ctx, arg) {
  if (!fields.name) return;
  if (arg?.name) {
    fields.name.value = arg.name;
    fields.newVersion.checked = Boolean(arg.newVersion);
  }
}

function choose(f) {
  file = f;
  fields.chosen.textContent = f ? `Chosen: ${f.name} (${f.size} bytes)` : "No file chosen.";
  if (f && !fields.name.value) fields.name.value = f.name.replace(/\.(jsonl|json|txt)$/i, "");
}

async function send(ctx) {
  const out = fields.result;
  if (!file) {
    fill(out, el("p", { class: "problem", role: "alert", text: "Choose a dataset file first." }));
    return;
  }
  const body = new FormData();
  body.append("file", file, file.name);
  body.append("name", fields.name.value.trim());
  body.append("method", fields.method.value);
  if (fields.config.value.trim()) body.append("config", fields.config.value);
  if (fields.newVersion.checked) body.append("new_version", "true");
  if (fields.force?.checked) body.append("force", "true");
  fields.submit.disabled = true;
  fill(out, el("p", { class: "muted", text: `Uploading ${file.name}…` }));
  try {
    const job = await api("/tasks", { method: "POST", form: body });
    fill(out, el("p", { text: `Accepted: job ${job.id} trains skill ${job.skill}.` }));
    ctx.go("jobs", { follow: job.id });
  } catch (e) {
    const bad = e.errors || [];
    fill(
      out,
      el("p", { class: "problem", role: "alert", "data-testid": "upload-error", text: `${e.status ?? ""} ${e.param ? `(${e.param}) ` : ""}${e.message}` }),
      bad.length
        ? el(
            "ol",
            { class: "bad-lines", "aria-label": "Bad lines", "data-testid": "bad-lines" },
            bad.map((b) =>
              el(
                "li",
                { "data-line": b.line },
                el("strong", { "data-testid": "bad-line-number", text: b.line ? `Line ${b.line}` : "File" }),
                b.field ? ` · ${b.field}` : "",
                `: ${b.message}`,
              ),
            ),
          )
        : null,
    );
  } finally {
    fields.submit.disabled = false;
  }
}
