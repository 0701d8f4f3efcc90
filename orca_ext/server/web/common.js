// What both pages share: the API key (asked for once, kept in localStorage), fetch with it,
// and reading server-sent events from a fetch response (EventSource cannot send the key).

const KEY_STORE = "orca.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

// The key's <dialog id="key-dialog">, added to the page the first time it is needed.
function keyDialog() {
  let dialog = document.getElementById("key-dialog");
  if (dialog) return dialog;
  dialog = document.createElement("dialog");
  dialog.id = "key-dialog";
  dialog.innerHTML = `<form><p class="key-message"></p>
    <input type="password" autocomplete="off" placeholder="API key" aria-label="API key">
    <button type="submit">Use this key</button></form>`;
  document.body.append(dialog);
  return dialog;
}

// Ask for the key in the key dialog; resolves once it is entered.
export function askKey(message) {
  const dialog = keyDialog();
  const input = dialog.querySelector("input");
  dialog.querySelector(".key-message").textContent = message;
  input.value = "";
  dialog.showModal();
  input.focus();
  return new Promise((resolve) => {
    dialog.querySelector("form").onsubmit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      localStorage.setItem(KEY_STORE, key);
      dialog.close();
      resolve(key);
    };
  });
}

// fetch with the stored key; on 401 ask for the key and try again.
export async function fetchWithKey(url, options = {}) {
  for (;;) {
    const key = apiKey();
    const headers = { ...(options.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(url, { ...options, headers });
    if (response.status !== 401) return response;
    await askKey(key ? "The API key was not accepted; enter it again." :
                       "This server needs an API key.");
  }
}

// The error message of an OpenAI-style error response (or its status line).
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (error) {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText}`;
}

// Call onEvent(name, data) for each server-sent event of a fetch response until it ends.
export async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

// Create an element with a class and text content.
export function element(tag, className = "", text = "") {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}
