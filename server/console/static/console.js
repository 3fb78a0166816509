// The console's entry point: the key, who it belongs to (whoami), the tabs, and a one-second tick for live views.

import { api, ApiError, getKey, setKey } from "./api.js";
import * as jobs from "./jobs.js";
import * as playground from "./playground.js";
import * as routing from "./routing.js";
import * as skills from "./skills.js";
import * as upload from "./upload.js";

const VIEWS = { skills, jobs, upload, routing, playground };
const NONE = { retire: false, rollback: false, train: false, fallback_clusters: false };
const $ = (id) => document.getElementById(id);

const ctx = {
  who: null,
  active: null,
  /** Open a view, with an optional argument (e.g. the job to follow, the skill to upload a new version of). */
  go(view, arg) {
    activate(view, arg);
  },
};

async function whoami() {
  try {
    return await api("/v1/skillpool/whoami");
  } catch (e) {
    if (!(e instanceof ApiError) || e.status === 401) throw e;
    // no whoami here: check the key on the models list; the admin is the one who may read the fallback clusters
    await api("/v1/models");
    const admin = await api("/v1/skillpool/fallback_clusters").then(
      () => true,
      () => false,
    );
    const can = admin ? { retire: true, rollback: true, train: true, fallback_clusters: true } : { ...NONE, train: true };
    return { name: null, role: admin ? "admin" : "unknown", keys_configured: true, can };
  }
}

function refuse(message) {
  $("app").hidden = true;
  $("app").replaceChildren(); // nothing of the pool stays in the page
  const error = $("auth-error");
  error.textContent = message;
  error.hidden = false;
  $("who").textContent = "Not signed in.";
}

function activate(name, arg) {
  if (!Object.hasOwn(VIEWS, name)) name = "skills"; // own views only: "#constructor" names no view
  ctx.active = name;
  for (const [view, module] of Object.entries(VIEWS)) {
    const on = view === name;
    const tab = $(`tab-${view}`);
    tab.setAttribute("aria-selected", on ? "true" : "false");
    tab.tabIndex = on ? 0 : -1;
    $(`view-${view}`).hidden = !on;
    if (!on) module.hide?.(ctx);
  }
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  VIEWS[name].show(ctx, arg);
}

function wireTabs() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  for (const tab of tabs) {
    tab.addEventListener("click", () => activate(tab.dataset.view));
    tab.addEventListener("keydown", (ev) => {
      const i = tabs.indexOf(tab);
      const next = ev.key === "ArrowRight" ? i + 1 : ev.key === "ArrowLeft" ? i - 1 : null;
      if (next === null) return;
      const to = tabs[(next + tabs.length) % tabs.length];
      to.focus();
      activate(to.dataset.view);
    });
  }
}

function wireKeyForm() {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setKey($("api-key").value.trim());
    location.reload(); // a fresh page: nothing the previous key saw stays on screen
  });
  $("forget-key").addEventListener("click", () => {
    setKey("");
    location.reload();
  });
}

async function start() {
  wireKeyForm();
  let who;
  try {
    who = await whoami();
  } catch (e) {
    const why = e instanceof ApiError ? e.message : String(e);
    refuse(getKey() ? `This key was refused (${why}): enter a valid key.` : `This server needs an API key (${why}): enter one above.`);
    return;
  }
  if (who.keys_configured && who.role === "anonymous") {
    refuse("This server has API keys: enter yours above to see the pool.");
    return;
  }
  ctx.who = { ...who, can: { ...NONE, ...(who.can || {}) } };
  $("who").textContent = who.keys_configured
    ? `Signed in as ${who.name ?? "(unnamed key)"}, role ${who.role}.`
    : "This server has no API keys: everything is open to anyone who reaches it.";
  for (const [view, module] of Object.entries(VIEWS)) module.init($(`view-${view}`), ctx);
  wireTabs();
  $("app").hidden = false;
  activate(location.hash.slice(1) || "skills");
  setInterval(() => VIEWS[ctx.active]?.tick?.(ctx), 1000);
}

start();
