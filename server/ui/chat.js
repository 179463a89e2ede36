// The chat page: talks to this server only through /v1/models and /v1/chat/completions.
// Conversations and settings live in localStorage; an API key, if the server wants one, in
// sessionStorage (this tab only). Model text reaches the DOM only as textContent or through
// renderMarkdown, which escapes all HTML first.
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const CHATS_KEY = "tallow.chats.v1";
const SETTINGS_KEY = "tallow.settings.v1";
const API_KEY = "tallow.apiKey";
// null: not sent, so the server applies the model's own default (its generation_config).
const DEFAULTS = { system: "", temperature: null, top_p: null, max_tokens: null };

let model = null; // {id, max_model_len}
let store = load(CHATS_KEY, { chats: [], current: null });
let settings = { ...DEFAULTS, ...load(SETTINGS_KEY, {}) };
let controller = null; // the AbortController of the reply being streamed

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(CHATS_KEY, JSON.stringify(store));
}

function current() {
  return store.chats.find((c) => c.id === store.current) ?? null;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- the API ------------------------------------------------------------------------------

function headers() {
  const key = sessionStorage.getItem(API_KEY);
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function askForKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key").value = "";
    dialog.addEventListener(
      "close",
      () => {
        sessionStorage.setItem(API_KEY, $("key").value.trim());
        resolve();
      },
      { once: true },
    );
    dialog.showModal();
  });
}

async function api(path, init = {}) {
  for (;;) {
    const response = await fetch(path, { ...init, headers: headers() });
    if (response.status !== 401) return response;
    sessionStorage.removeItem(API_KEY);
    await askForKey();
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModel() {
  try {
    const response = await api("v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    model = (await response.json()).data[0];
    $("model-name").textContent = model.id;
    const ctx = model.max_model_len;
    $("model-ctx").textContent = ctx ? `context ${ctx.toLocaleString("en")} tokens` : "";
  } catch (e) {
    $("model-name").textContent = `no model: ${e.message}`;
  }
}

// Server-sent events from a fetch body: yields each `data:` payload.
async function* sseData(body, signal) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split(/\r?\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line.startsWith("data:")) yield line.slice(5).trim();
      }
    }
  } finally {
    if (signal.aborted) reader.cancel().catch(() => {});
  }
}

// -- sending ------------------------------------------------------------------------------

function requestMessages(chat) {
  const out = settings.system.trim() ? [{ role: "system", content: settings.system }] : [];
  for (const m of chat.messages) {
    if (m.role === "user" || m.content) out.push({ role: m.role, content: m.content });
  }
  return out;
}

async function send(text) {
  let chat = current();
  if (!chat) chat = newChat();
  chat.messages.push({ role: "user", content: text });
  if (chat.messages.length === 1) chat.title = text.slice(0, 60);
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [], state: "streaming" };
  const body = {
    model: model?.id,
    messages: requestMessages(chat),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (settings.temperature !== null) body.temperature = settings.temperature;
  if (settings.top_p !== null) body.top_p = settings.top_p;
  if (settings.max_tokens) body.max_tokens = settings.max_tokens; // else: what the context allows
  chat.messages.push(reply);
  save();
  renderAll();
  const node = $("messages").lastElementChild;
  setBusy(true);
  controller = new AbortController();
  const started = performance.now();
  let first = null;
  let usage = null;
  let pending = false;
  const paint = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      updateMessage(node, reply);
      scrollDown();
    });
  };
  try {
    const response = await api("v1/chat/completions", {
      method: "POST",
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response.body, controller.signal)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta;
      if (!delta) continue;
      if (delta.content || delta.reasoning_content || delta.tool_calls) first ??= performance.now();
      reply.content += delta.content ?? "";
      reply.reasoning += delta.reasoning_content ?? "";
      for (const call of delta.tool_calls ?? []) {
        const slot = (reply.tool_calls[call.index ?? 0] ??= { id: "", name: "", arguments: "" });
        slot.id ||= call.id ?? "";
        slot.name += call.function?.name ?? "";
        slot.arguments += call.function?.arguments ?? "";
      }
      paint();
    }
    reply.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      reply.state = "stopped";
    } else {
      reply.state = "error";
      reply.error = e.message;
    }
  } finally {
    const end = performance.now();
    reply.stats = stats(started, first, end, usage);
    controller = null;
    setBusy(false);
    save();
    updateMessage(node, reply);
    scrollDown();
  }
}

function stats(started, first, end, usage) {
  const out = { ttft: first === null ? null : (first - started) / 1000 };
  if (usage) {
    out.tokens = usage.completion_tokens;
    // Decode speed: the tokens after the first over the time after the first.
    const span = first === null ? 0 : (end - first) / 1000;
    out.tps = out.tokens > 1 && span > 0 ? (out.tokens - 1) / span : null;
  }
  return out;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  $("new-chat").disabled = busy;
}

// -- conversations ------------------------------------------------------------------------

function newChat() {
  const chat = { id: crypto.randomUUID(), title: "New chat", messages: [], created: Date.now() };
  store.chats.unshift(chat);
  store.current = chat.id;
  save();
  return chat;
}

function renderChats() {
  const nav = $("chats");
  nav.replaceChildren();
  for (const chat of store.chats) {
    const item = el("div", `chat-item${chat.id === store.current ? " current" : ""}`);
    const open = el("button", "open", chat.title || "New chat");
    open.type = "button";
    open.title = chat.title;
    open.addEventListener("click", () => {
      if (controller) return;
      store.current = chat.id;
      save();
      renderAll();
    });
    const del = el("button", "delete", "×");
    del.type = "button";
    del.title = "Delete this conversation";
    del.addEventListener("click", () => {
      if (controller) return;
      store.chats = store.chats.filter((c) => c !== chat);
      if (store.current === chat.id) store.current = store.chats[0]?.id ?? null;
      save();
      renderAll();
    });
    item.append(open, del);
    nav.append(item);
  }
}

function messageNode(m) {
  const node = el("div", `msg ${m.role}`);
  node.append(el("div", "role", m.role === "user" ? "you" : model?.id ?? "assistant"));
  if (m.role === "assistant") {
    const details = el("details", "reasoning");
    details.append(el("summary", null, "Reasoning"), el("div", "reasoning-body"));
    details.hidden = true;
    node.append(details, el("div", "body"), el("div", "tool-calls"), el("div", "meta"));
  } else {
    node.append(el("div", "body", m.content));
  }
  return node;
}

function updateMessage(node, m) {
  node.dataset.state = m.state ?? "done";
  const details = node.querySelector(".reasoning");
  details.hidden = !m.reasoning;
  if (m.reasoning) node.querySelector(".reasoning-body").innerHTML = renderMarkdown(m.reasoning);
  node.querySelector(".body").innerHTML = renderMarkdown(m.content);
  const calls = node.querySelector(".tool-calls");
  calls.replaceChildren();
  for (const call of m.tool_calls ?? []) {
    const box = el("div", "tool-call");
    box.append(el("span", "label", "tool call"), el("code", "name", call.name));
    let args = call.arguments;
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {}
    box.append(el("pre", "arguments", args));
    calls.append(box);
  }
  const meta = node.querySelector(".meta");
  meta.replaceChildren();
  const s = m.stats;
  const parts = [];
  if (m.state === "stopped") parts.push("stopped");
  if (s?.tokens !== undefined) parts.push(`${s.tokens} tokens`);
  if (s?.tps) parts.push(`${s.tps.toFixed(1)} tok/s`);
  if (s?.ttft !== null && s?.ttft !== undefined) parts.push(`first token ${s.ttft.toFixed(2)} s`);
  meta.textContent = parts.join(" · ");
  if (m.error) meta.prepend(el("span", "error", `error: ${m.error} `));
}

function renderAll() {
  renderChats();
  const box = $("messages");
  box.replaceChildren();
  for (const m of current()?.messages ?? []) {
    const node = messageNode(m);
    box.append(node);
    if (m.role === "assistant") updateMessage(node, m);
  }
  scrollDown();
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

// -- settings -----------------------------------------------------------------------------

function bindSettings() {
  const fields = [
    ["system", "system", String],
    ["temperature", "temperature", Number],
    ["top-p", "top_p", Number],
    ["max-tokens", "max_tokens", (v) => (v === "" ? null : Math.max(1, Math.round(Number(v))))],
  ];
  for (const [id, key, parse] of fields) {
    const input = $(id);
    const shown = $(`${id}-value`);
    input.value = settings[key] ?? "";
    if (shown) shown.textContent = settings[key] ?? "model's";
    input.addEventListener("input", () => {
      settings[key] = parse(input.value);
      if (shown) shown.textContent = settings[key] ?? "model's";
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
    });
  }
}

// -- start --------------------------------------------------------------------------------

function submit() {
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  submit();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    submit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", () => {
  const chat = current();
  if (!chat || chat.messages.length) newChat();
  renderAll();
  $("prompt").focus();
});
// A reply cut off by a reload (or a closed tab) was not finished.
for (const m of store.chats.flatMap((c) => c.messages)) {
  if (m.state === "streaming") m.state = "stopped";
}
bindSettings();
renderAll();
loadModel().then(() => controller || renderAll());
