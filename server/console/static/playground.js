// Playground: chat with `auto`, a forced skill or a mix; each answer shows its route (skills, weights, reason,
// score, and the x-skillpool-route header) and its timings; streaming or not.

import { api, ApiError, request } from "./api.js";
import { el, fill, num, problem } from "./dom.js";

const MIX = "__mix__";
let root;
let f = {};
let transcript;
let history = []; // the conversation sent with each request: [{role, content}]

export function init(section) {
  root = section;
  f = {
    model: el("select", { id: "play-model" }, el("option", { value: "auto", text: "auto (the router picks)" })),
    mix: el("input", { id: "play-mix", type: "text", placeholder: "skill=0.7,other=0.3", spellcheck: "false" }),
    prompt: el("textarea", { id: "play-prompt", rows: 4, required: true }),
    maxTokens: el("input", { id: "play-max-tokens", type: "number", min: 1, max: 4096, value: 64 }),
    temperature: el("input", { id: "play-temperature", type: "number", min: 0, max: 2, step: 0.1, value: 0 }),
    stream: el("input", { id: "play-stream", type: "checkbox", checked: true }),
    send: el("button", { type: "submit", text: "Send" }),
    clear: el("button", { type: "button", text: "New chat" }),
  };
  const mixField = el("div", { class: "field", hidden: true }, el("label", { for: f.mix.id, text: "Mix (skill=weight, …)" }), f.mix);
  f.model.addEventListener("change", () => {
    mixField.hidden = f.model.value !== MIX;
  });
  f.clear.addEventListener("click", () => {
    history = [];
    transcript.replaceChildren();
  });
  transcript = el("ol", { class: "transcript", "data-testid": "transcript", "aria-label": "Conversation", "aria-live": "polite" });
  const field = (label, input) => el("div", { class: "field" }, el("label", { for: input.id, text: label }), input);
  const form = el(
    "form",
    { class: "playground", "aria-label": "Chat" },
    el("div", { class: "row" }, field("Model", f.model), mixField, field("Max tokens", f.maxTokens), field("Temperature", f.temperature), el("div", { class: "field check" }, f.stream, el("label", { for: f.stream.id, text: "Stream" }))),
    field("Prompt", f.prompt),
    el("div", { class: "row" }, f.send, f.clear),
  );
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    send();
  });
  fill(root, el("h2", { text: "Playground" }), form, transcript);
}

export async function show() {
  try {
    const models = (await api("/v1/models")).data || [];
    const keep = f.model.value;
    fill(
      f.model,
      models.map((m) => el("option", { value: m.id, text: m.id === "auto" ? "auto (the router picks)" : m.skill ? `${m.id} (skill)` : `${m.id} (base model)` })),
      el("option", { value: MIX, text: "a mix of skills…" }),
    );
    f.model.value = [...f.model.options].some((o) => o.value === keep) ? keep : "auto";
  } catch (e) {
    root.append(problem(e));
  }
}

function routeDetails(sp) {
  if (!sp) return null;
  const route = sp.route || [];
  return el(
    "p",
    { class: "route" },
    "Reason: ",
    el("span", { "data-testid": "route-reason", text: sp.reason ?? "–" }),
    ` · score ${num(sp.score)} · `,
    route.length ? route.map((r) => `${r.skill} ${num(r.weight, 2)}`).join(", ") : "base model (no skill)",
  );
}

async function send() {
  const text = f.prompt.value;
  if (!text.trim()) return;
  const model = f.model.value === MIX ? f.mix.value.trim() : f.model.value;
  const stream = f.stream.checked;
  const messages = [...history, { role: "user", content: text }];
  const body = { model, messages, max_tokens: Number(f.maxTokens.value) || 64, temperature: Number(f.temperature.value) || 0, stream };
  if (stream) body.stream_options = { include_usage: true };
  const answer = el("p", { class: "answer", "data-testid": "answer" });
  const route = el("code", { "data-testid": "route", text: "…" });
  const details = el("div", {});
  const timings = el("p", { class: "muted", "data-testid": "timings" });
  const turn = el("li", { class: "turn assistant", "data-testid": "answer-turn" }, el("span", { class: "speaker", text: `${model}:` }), answer, el("p", { class: "route" }, "Route: ", route), details, timings);
  transcript.append(el("li", { class: "turn user" }, el("span", { class: "speaker", text: "You:" }), el("p", { "data-testid": "prompt-text", text })), turn);
  f.send.disabled = true;
  const t0 = performance.now();
  let first = null;
  let tokens = null;
  try {
    const res = await request("/v1/chat/completions", { method: "POST", json: body });
    route.textContent = res.headers.get("x-skillpool-route") || "(no header)";
    if (!res.ok) {
      const raw = await res.text();
      let parsed = null;
      try {
        parsed = JSON.parse(raw);
      } catch {
        parsed = null;
      }
      throw new ApiError(res.status, parsed, res.statusText);
    }
    let content = "";
    if (stream) {
      for await (const chunk of events(res)) {
        if (chunk.error) throw new Error(chunk.error.message || "generation failed");
        if (chunk.skillpool) details.replaceChildren(routeDetails(chunk.skillpool));
        const delta = chunk.choices?.[0]?.delta?.content;
        if (delta) {
          first ??= performance.now();
          content += delta;
          answer.textContent = content;
        }
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
      }
    } else {
      const data = await res.json();
      first = performance.now();
      content = data.choices?.[0]?.message?.content ?? "";
      answer.textContent = content;
      details.replaceChildren(routeDetails(data.skillpool));
      tokens = data.usage?.completion_tokens ?? null;
    }
    const total = performance.now() - t0;
    timings.textContent = `${stream ? "first token" : "answer"} after ${Math.round((first ?? performance.now()) - t0)} ms · total ${Math.round(total)} ms${tokens !== null ? ` · ${tokens} token${tokens === 1 ? "" : "s"}` : ""}`;
    history = [...messages, { role: "assistant", content }];
    f.prompt.value = "";
  } catch (e) {
    turn.append(problem(e));
  } finally {
    f.send.disabled = false;
  }
}

/** The JSON objects of a server-sent event stream, until [DONE]. */
async function* events(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}
