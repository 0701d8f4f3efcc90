// The chat page: conversations kept in localStorage, replies streamed from
// /v1/chat/completions and rendered as Markdown, a stop button that aborts the request (the
// server then aborts it in the engine and frees its KV), and per reply TTFT and tokens/s.

import { element, errorMessage, fetchWithKey, readEvents } from "/ui/common.js";
import { renderMarkdown } from "/ui/markdown.js";

const STORE = "orca.chat.conversations";
const CURRENT = "orca.chat.current";
const SETTINGS = "orca.chat.settings";
const DEFAULTS = { system: "", temperature: 0.7, top_p: 0.95, max_tokens: 512, seed: "" };
const FIELDS = { system: "system-prompt", temperature: "temperature", top_p: "top-p",
                 max_tokens: "max-tokens", seed: "seed" };

const $ = (id) => document.getElementById(id);
let conversations = load(STORE, []);
let currentId = localStorage.getItem(CURRENT);
const settings = { ...DEFAULTS, ...load(SETTINGS, {}) };
let model = null;  // the server's model: { id, max_model_len }
let running = null;  // the reply streaming now: { conversation, reply, controller }
const nodes = new WeakMap();  // message -> its element, while shown
let renderQueued = false;
let savedAt = 0;  // when a streaming reply was last saved (a reload keeps what it had)

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch (error) {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    if (currentId) localStorage.setItem(CURRENT, currentId);
    else localStorage.removeItem(CURRENT);
  } catch (error) {  // the browser's storage is full: this page keeps working without it
    console.warn(`conversations not saved: ${error.message}`);
  }
}

function current() {
  return conversations.find((c) => c.id === currentId) || null;
}

function newConversation() {
  const conversation = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 8),
                         title: "", created: Date.now(), messages: [] };
  conversations.unshift(conversation);
  currentId = conversation.id;
  return conversation;
}

function select(id) {
  currentId = id;
  save();
  renderList();
  renderMessages();
}

function remove(id) {
  if (running && running.conversation.id === id) running.controller.abort();
  conversations = conversations.filter((c) => c.id !== id);
  if (currentId === id) currentId = conversations.length ? conversations[0].id : null;
  save();
  renderList();
  renderMessages();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const item = element("li", c.id === currentId ? "active" : "");
    item.dataset.id = c.id;
    const open = element("button", "open", c.title || "New chat");
    open.type = "button";
    open.title = c.title;
    open.onclick = () => select(c.id);
    const del = element("button", "delete", "×");
    del.type = "button";
    del.title = "Delete this conversation";
    del.onclick = () => remove(c.id);
    item.append(open, del);
    list.append(item);
  }
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const conversation = current();
  if (!conversation || !conversation.messages.length) {
    box.append(element("div", "empty", `Ask ${model ? model.id : "the model"} anything.`));
    return;
  }
  for (const message of conversation.messages) box.append(messageNode(message));
  box.scrollTop = box.scrollHeight;
}

function messageNode(message) {
  const node = element("div", `message ${message.role}`);
  const body = element("div", "body");
  node.append(body);
  if (message.role === "assistant") node.append(element("div", "meta"));
  nodes.set(message, node);
  fill(message);
  return node;
}

// Put a message's text (Markdown for replies) and its reply statistics into its element.
function fill(message) {
  const node = nodes.get(message);
  if (!node) return;
  const body = node.querySelector(".body");
  if (message.role !== "assistant") {
    body.textContent = message.content;
    return;
  }
  body.innerHTML = renderMarkdown(message.content);
  for (const pre of body.querySelectorAll("pre")) {
    const copy = element("button", "copy", "copy");
    copy.type = "button";
    copy.onclick = () => navigator.clipboard && navigator.clipboard.writeText(pre.innerText);
    pre.append(copy);
  }
  const meta = node.querySelector(".meta");
  meta.textContent = describe(message);
  node.classList.toggle("failed", Boolean(message.error));
  node.classList.toggle("pending", Boolean(message.pending));
}

function describe(message) {
  if (message.pending) return message.content ? "streaming…" : "waiting for the first token…";
  const parts = [];
  const s = message.stats || {};
  if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (s.tokens_per_s != null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
  if (s.tokens != null) parts.push(`${s.approx ? "≈" : ""}${s.tokens} tokens`);
  const endings = { stopped: "stopped", length: "max tokens reached" };
  if (endings[s.finish]) parts.push(endings[s.finish]);
  if (message.error) parts.push(`error: ${message.error}`);
  return parts.join(" · ");
}

function queueRender(message) {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    fill(message);
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
    if (performance.now() - savedAt > 1000) {
      savedAt = performance.now();
      save();
    }
  });
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || running) return;
  const conversation = current() || newConversation();
  if (!conversation.title) conversation.title = text.slice(0, 60);
  conversation.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", pending: true };
  conversation.messages.push(reply);
  conversations = [conversation, ...conversations.filter((c) => c !== conversation)];
  $("prompt").value = "";
  save();
  renderList();
  renderMessages();
  await stream(conversation, reply);
}

function requestBody(conversation, reply) {
  const messages = settings.system ? [{ role: "system", content: settings.system }] : [];
  for (const m of conversation.messages) {
    if (m === reply) break;
    if (m.role === "user" || (m.content && !m.error)) messages.push({ role: m.role, content: m.content });
  }
  const body = { messages, stream: true, stream_options: { include_usage: true },
                 temperature: Number(settings.temperature), top_p: Number(settings.top_p),
                 max_tokens: Number(settings.max_tokens) };
  if (model) body.model = model.id;
  if (settings.seed !== "" && settings.seed !== null) body.seed = Number(settings.seed);
  return body;
}

async function stream(conversation, reply) {
  const controller = new AbortController();
  running = { conversation, reply, controller };
  setBusy(true);
  const started = performance.now();
  let first = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  try {
    const response = await fetchWithKey("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(conversation, reply)), signal: controller.signal });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const text = choice.delta && choice.delta.content;
      if (text) {
        if (first === null) first = performance.now();
        chunks++;
        reply.content += text;
        queueRender(reply);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    });
  } catch (error) {
    if (error.name === "AbortError") {
      finish = "stopped";
    } else {
      reply.error = error.message;
      controller.abort();  // close the stream if it is still open
    }
  }
  const ended = performance.now();
  const tokens = usage ? usage.completion_tokens : chunks;
  reply.stats = {
    ttft_ms: first === null ? null : first - started, tokens, approx: !usage, finish,
    tokens_per_s: first !== null && tokens > 1 && ended > first ?
      (tokens - 1) / ((ended - first) / 1000) : null,
  };
  delete reply.pending;
  running = null;
  setBusy(false);
  save();
  fill(reply);
}

async function loadModel() {
  try {
    const response = await fetchWithKey("/v1/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    model = (await response.json()).data[0];
    $("model").textContent = `${model.id} · context ${model.max_model_len} tokens`;
    if (Number(settings.max_tokens) >= model.max_model_len) {
      settings.max_tokens = Math.floor(model.max_model_len / 2);
      showSettings();
    }
  } catch (error) {
    $("model").textContent = `server unreachable: ${error.message}`;
  }
  renderMessages();
}

function showSettings() {
  for (const [name, id] of Object.entries(FIELDS)) $(id).value = settings[name];
}

function bindSettings() {
  showSettings();
  for (const [name, id] of Object.entries(FIELDS)) {
    $(id).addEventListener("input", () => {
      settings[name] = $(id).value;
      localStorage.setItem(SETTINGS, JSON.stringify(settings));
    });
  }
  $("settings-toggle").onclick = () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
  };
  $("settings").onsubmit = (event) => event.preventDefault();
}

// A conversation saved while its reply was streaming (the page was closed) shows what it got.
for (const c of conversations) {
  for (const m of c.messages) {
    if (m.pending) {
      delete m.pending;
      m.stats = { finish: "stopped" };
    }
  }
}
if (!current()) currentId = conversations.length ? conversations[0].id : null;
bindSettings();
renderList();
renderMessages();
$("composer").onsubmit = (event) => {
  event.preventDefault();
  send();
};
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
$("stop").onclick = () => running && running.controller.abort();
$("new-chat").onclick = () => {
  if (!(current() && !current().messages.length)) newConversation();
  save();
  renderList();
  renderMessages();
  $("prompt").focus();
};
loadModel();
