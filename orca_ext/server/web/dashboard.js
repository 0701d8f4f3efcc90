// The engine dashboard: reads /dashboard/events (a "hello" with the configuration and the
// recent record, then a "sample" a few times a second) and draws the iteration strip, the
// requests, the KV cache and the rates. Records are numbered; ones already drawn are skipped.

import { element, fetchWithKey, readEvents } from "/ui/common.js";

const LANE_HEIGHT = 9;  // pixels per request row in the strip (matches style.css)
const COLUMN_WIDTH = 9;  // pixels per iteration column (matches style.css)
const EVENTS_SHOWN = 60;
const LIVE_SHOWN = 100;
const HISTORY_SECONDS = 60;
const IDLE_GAP = 0.5;  // seconds between iterations drawn as a gap in the strip

const $ = (id) => document.getElementById(id);
let config = null;
let lastIteration = -1;
let lastEvent = -1;
let lastEnd = null;  // the previous iteration's end time
const lanes = new Map();  // sequence id -> its row in the strip while it runs
const labels = new Map();  // sequence id -> request id
let history = [];  // [time, tokens/s, KV used %, queue length] per sample

function reset() {
  lastIteration = lastEvent = -1;
  lastEnd = null;
  lanes.clear();
  labels.clear();
  history = [];
  $("strip").replaceChildren();
  $("events").replaceChildren();
}

function lane(sequence) {
  if (!lanes.has(sequence)) {
    const used = new Set(lanes.values());
    let free = 0;
    while (used.has(free)) free++;
    lanes.set(sequence, free);
  }
  return lanes.get(sequence);
}

function maxColumns() {
  return Math.max(20, Math.floor($("strip").clientWidth / COLUMN_WIDTH));
}

function apply(message) {
  for (const l of message.live) labels.set(l[0], l[1]);
  for (const e of message.events) labels.set(e[3], e[4]);
  const live = new Set(message.live.map((l) => l[0]));
  const fresh = message.iterations.filter((it) => it[0] > lastIteration).slice(-maxColumns());
  const lastSeen = new Map();
  for (const [number, , , entries] of fresh) {
    for (const entry of entries) lastSeen.set(entry[0], number);
  }
  for (const iteration of fresh) {
    addColumn(iteration);
    for (const entry of iteration[3]) {  // a finished request's row is free once drawn
      if (lastSeen.get(entry[0]) === iteration[0] && !live.has(entry[0])) lanes.delete(entry[0]);
    }
  }
  for (const sequence of lanes.keys()) if (!live.has(sequence)) lanes.delete(sequence);
  if (message.iterations.length) lastIteration = Math.max(lastIteration, message.iterations.at(-1)[0]);
  trimStrip();
  for (const event of message.events) {
    if (event[0] > lastEvent) addEvent(event);
  }
  if (message.events.length) lastEvent = Math.max(lastEvent, message.events.at(-1)[0]);
  showLive(message);
  showStats(message);
}

function addColumn([number, start, end, entries]) {
  const column = element("div", "iter");
  column.dataset.n = number;
  if (lastEnd !== null && start - lastEnd > IDLE_GAP) column.classList.add("gap");
  lastEnd = end;
  const ms = (end - start) * 1000;
  column.dataset.ms = ms;
  const timeBox = element("div", "time-box");
  timeBox.append(element("div", "time"));
  column.append(timeBox);
  const cells = element("div", "cells");
  let rows = 0;
  let prefill = 0;
  let decode = 0;
  for (const [sequence, p, d, cached] of entries) {
    prefill += p;
    decode += d;
    const label = labels.get(sequence) || `#${sequence}`;
    const cell = element("div", `cell ${d ? "decode" : cached ? "prefill cached" : "prefill"}`);
    const row = lane(sequence);
    rows = Math.max(rows, row + 1);
    cell.style.top = `${row * LANE_HEIGHT}px`;
    cell.dataset.rid = label;
    cell.title = d ? `${label}: decode, 1 token` :
      `${label}: prefill, ${p} tokens${cached ? ` (${cached} more from the prefix cache)` : ""}`;
    cells.append(cell);
  }
  column.append(cells);
  column.dataset.rows = rows;
  column.title = `iteration ${number}: ${ms.toFixed(1)} ms, ${entries.length} requests, ` +
                 `${prefill} prefill + ${decode} decode tokens`;
  $("strip").append(column);
}

function trimStrip() {
  const strip = $("strip");
  const excess = strip.children.length - maxColumns();
  for (let i = 0; i < excess; i++) strip.firstElementChild.remove();
  // Iteration-time bars relative to the slowest iteration shown; rows as tall as needed.
  let slowest = 0;
  let rows = 1;
  for (const column of strip.children) {
    slowest = Math.max(slowest, Number(column.dataset.ms));
    rows = Math.max(rows, Number(column.dataset.rows));
  }
  for (const column of strip.children) {
    column.querySelector(".time").style.height = `${(100 * Number(column.dataset.ms)) / (slowest || 1)}%`;
  }
  strip.style.setProperty("--rows", rows);
}

function clock(seconds) {
  const date = new Date(seconds * 1000);
  return date.toLocaleTimeString([], { hour12: false }) +
         `.${String(date.getMilliseconds()).padStart(3, "0")}`;
}

function addEvent([, time, kind, , label, detail, outputs]) {
  const item = element("li", `event ${kind}`);
  item.dataset.rid = label;
  item.append(element("span", "when", clock(time)),
              element("span", "kind", kind === "arrive" ? "arrived" : `ended (${detail})`),
              element("span", "rid", label),
              element("span", "detail", kind === "arrive" ? `${detail} prompt tokens` :
                                                            `${outputs} tokens generated`));
  const list = $("events");
  list.prepend(item);
  while (list.children.length > EVENTS_SHOWN) list.lastElementChild.remove();
}

function showLive(message) {
  const rows = message.live.slice(0, LIVE_SHOWN).map(([, label, state, prompt, outputs, arrival]) => {
    const row = element("tr", state);
    row.dataset.rid = label;
    for (const text of [label, state, prompt, outputs, `${(message.time - arrival).toFixed(1)} s`]) {
      row.append(element("td", "", String(text)));
    }
    return row;
  });
  if (message.live.length > LIVE_SHOWN) {
    const more = element("tr", "more");
    const cell = element("td", "", `… and ${message.live.length - LIVE_SHOWN} more`);
    cell.colSpan = 5;
    more.append(cell);
    rows.push(more);
  }
  if (!rows.length) {
    const idle = element("tr", "idle");
    const cell = element("td", "", "no requests");
    cell.colSpan = 5;
    idle.append(cell);
    rows.push(idle);
  }
  $("live").replaceChildren(...rows);
}

function milliseconds(seconds) {
  return seconds == null ? "–" : `${(seconds * 1000).toFixed(seconds < 0.1 ? 1 : 0)} ms`;
}

function showStats(message) {
  const s = message.stats;
  const r = message.rates;
  $("waiting").textContent = s.waiting;
  $("running").textContent = s.running;
  $("running-note").textContent = `holding KV · max batch ${config.max_batch_size}`;
  $("tokens-per-s").textContent = r.tokens_per_s == null ? "–" : r.tokens_per_s.toFixed(1);
  $("ttft").textContent = milliseconds(r.ttft_s);
  $("ttft-note").textContent = `mean, requests ended in the last 30 s (since start: ${milliseconds(r.ttft_mean_s)})`;
  $("itl").textContent = milliseconds(r.itl_s);
  $("itl-note").textContent = `mean, requests ended in the last 30 s (since start: ${milliseconds(r.itl_mean_s)})`;
  $("iterations").textContent = s.iterations;
  const last = $("strip").lastElementChild;
  $("iteration-note").textContent = last ? `since start · last ${Number(last.dataset.ms).toFixed(1)} ms` : "since start";
  const total = s.total_blocks;
  const held = s.used_blocks;
  const evictable = s.evictable_blocks;
  const bar = $("kv-bar");
  bar.querySelector(".kv-used").style.width = `${(100 * held) / total}%`;
  bar.querySelector(".kv-evictable").style.width = `${(100 * evictable) / total}%`;
  const tokens = config.block_size;
  let text = `used ${held} of ${total} blocks (${tokens} tokens each) · free ${total - held}`;
  if (config.enable_prefix_caching) {
    const rate = s.prefix_cache_queries ? (100 * s.prefix_cache_hits) / s.prefix_cache_queries : 0;
    text += ` (${evictable} of them cached, evictable) · prefix cache: ${s.cached_blocks} blocks,` +
            ` hits ${s.prefix_cache_hits} of ${s.prefix_cache_queries} prompt tokens (${rate.toFixed(1)} %)`;
  } else {
    text += " · prefix caching off";
  }
  if (s.preemptions) text += ` · ${s.preemptions} preemptions`;
  $("kv-text").textContent = text;
  const connection = $("connection");
  connection.textContent = message.healthy ? "live" : "engine not healthy";
  connection.className = `connection ${message.healthy ? "live" : "down"}`;
  history.push([message.time, r.tokens_per_s || 0, (100 * held) / total, s.waiting]);
  history = history.filter((h) => h[0] >= message.time - HISTORY_SECONDS);
  spark("spark-tokens", 1);
  spark("spark-kv", 2, 100);
  spark("spark-queue", 3);
}

function spark(id, column, fixedTop = 0) {
  const canvas = $(id);
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  context.clearRect(0, 0, width, height);
  if (history.length < 2) return;
  const top = fixedTop || Math.max(1, ...history.map((h) => h[column]));
  const t0 = history.at(-1)[0] - HISTORY_SECONDS;
  context.strokeStyle = getComputedStyle(canvas).color;
  context.lineWidth = 1.5;
  context.beginPath();
  history.forEach((h, i) => {
    const x = ((h[0] - t0) / HISTORY_SECONDS) * width;
    const y = height - 2 - (h[column] / top) * (height - 14);
    if (i) context.lineTo(x, y);
    else context.moveTo(x, y);
  });
  context.stroke();
  context.fillStyle = context.strokeStyle;
  context.font = "11px system-ui, sans-serif";
  context.fillText(`max ${top.toFixed(top < 10 ? 1 : 0)} · now ${history.at(-1)[column].toFixed(1)}`, 4, 11);
}

function showConfig() {
  const c = config;
  const items = [
    ["model", c.model], ["context", `${c.max_model_len} tokens`], ["policy", c.policy],
    ["max batch size", c.max_batch_size],
    ["max batched tokens", c.max_num_batched_tokens ?? "no limit"],
    ["batches in flight", c.num_batches_in_flight],
    ["KV cache", `${c.num_blocks} blocks × ${c.block_size} tokens`],
    ["prefix caching", c.enable_prefix_caching ? "on" : "off"],
    ["sampled every", `${c.sample_interval * 1000} ms`],
  ];
  $("config").replaceChildren(...items.map(([name, value]) => {
    const item = element("span", "item");
    item.append(element("span", "name", name), element("span", "value", String(value)));
    return item;
  }));
}

async function connect() {
  for (;;) {
    try {
      const response = await fetchWithKey("/dashboard/events");
      if (!response.ok) throw new Error(`${response.status}`);
      await readEvents(response, (name, data) => {
        try {
          const message = JSON.parse(data);
          if (name === "hello") {
            reset();
            config = message.config;
            showConfig();
          }
          apply(message);
        } catch (error) {
          console.error(error);  // a fault of this page, not of the connection
          throw error;
        }
      });
    } catch (error) {
      // the server went away or restarted: show it and try again
    }
    const connection = $("connection");
    connection.textContent = "reconnecting…";
    connection.className = "connection down";
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

connect();
