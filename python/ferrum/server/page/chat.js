// The chat page: a conversation with this server's /v1/chat/completions (streamed), kept in
// localStorage. It talks to its own origin only (the page's Content-Security-Policy says so too).
"use strict";

(() => {
  const STORE = {conversation: "ferrum.chat.conversation", settings: "ferrum.chat.settings", key: "ferrum.chat.apiKey"};
  const DEFAULTS = {system: "", temperature: 0.7, top_p: 0.95, max_tokens: null, seed: null, extra: "", model: null};
  const $ = (id) => document.getElementById(id);

  let settings = {...DEFAULTS, ...read(STORE.settings, {})};
  let conversation = read(STORE.conversation, null) || newConversation();
  let models = [];
  let running = null;  // the AbortController of the reply being streamed
  let keyPrompt = null;  // the key dialog's pending answer, when it is open

  function read(name, fallback) {
    try {
      const value = JSON.parse(localStorage.getItem(name));
      return value ?? fallback;
    } catch {
      return fallback;
    }
  }

  function newConversation() {
    return {created: new Date().toISOString(), messages: []};
  }

  function saveConversation() {
    localStorage.setItem(STORE.conversation, JSON.stringify(conversation));
  }

  // ---- talking to the server ----

  class RequestFailed extends Error {}

  // fetch on this origin with the API key, asking for a key when the server answers 401.
  async function api(path, init = {}) {
    for (;;) {
      const key = localStorage.getItem(STORE.key);
      const headers = {...(init.headers || {})};
      if (key) headers.Authorization = `Bearer ${key}`;
      let response;
      try {
        response = await fetch(path, {...init, headers});
      } catch (e) {
        if (e.name === "AbortError") throw e;
        throw new RequestFailed(`Cannot reach the server at ${location.origin}: is \`ferrum serve\` still running? (${e.message})`);
      }
      if (response.status !== 401) return response;
      const given = await askKey(key ? "The server refused the API key kept in this browser." :
        "This server needs an API key (`ferrum serve --api-key`).");
      if (given === null) throw new RequestFailed("The server needs an API key (401).");
    }
  }

  async function failure(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
    } catch { /* not JSON: the status says it */ }
    return new RequestFailed(`The server answered ${message}`);
  }

  function askKey(reason) {
    if (!keyPrompt) {
      $("key-reason").textContent = reason;
      $("key-input").value = "";
      keyPrompt = new Promise((resolve) => {
        const dialog = $("key-dialog");
        const done = (value) => {
          keyPrompt = null;
          dialog.onclose = null;
          resolve(value);
        };
        dialog.onclose = () => {
          const key = $("key-input").value.trim();
          if (dialog.returnValue === "save" && key) {
            localStorage.setItem(STORE.key, key);
            done(key);
          } else done(null);
        };
        dialog.returnValue = "";
        dialog.showModal();
      });
    }
    return keyPrompt;
  }

  async function loadModels() {
    try {
      const response = await api("/v1/models");
      if (!response.ok) throw await failure(response);
      models = (await response.json()).data.map((m) => m.id);
      showModels();
      clearBanner();
    } catch (e) {
      banner(e.message);
    }
  }

  function showModels() {
    const select = $("model-select");
    const many = models.length > 1;
    if (!models.includes(settings.model)) settings.model = models[0] ?? null;
    select.hidden = !many;
    $("model-name").hidden = many;
    $("model-name").textContent = settings.model ?? "";
    select.replaceChildren(...models.map((id) => new Option(id, id, false, id === settings.model)));
  }

  function requestBody() {
    const messages = [];
    if (settings.system.trim()) messages.push({role: "system", content: settings.system});
    for (const m of conversation.messages) {
      if (!m.pending && !(m.role === "assistant" && m.error && !m.content)) messages.push({role: m.role, content: m.content});
    }
    const body = {messages, stream: true, stream_options: {include_usage: true}};
    if (settings.model) body.model = settings.model;
    for (const field of ["temperature", "top_p", "max_tokens", "seed"]) {
      if (settings[field] !== null) body[field] = settings[field];
    }
    return {...body, ...(settings.extra.trim() ? JSON.parse(settings.extra) : {})};
  }

  // Streams a reply to the conversation as it stands into a new assistant message.
  async function reply() {
    const body = requestBody();
    const message = {role: "assistant", content: "", model: body.model, pending: true};
    conversation.messages.push(message);
    running = new AbortController();
    setRunning(true);
    render();
    const started = performance.now();
    let first = null, last = null, chunks = 0, usage = null, finish = null;
    try {
      const response = await api("/v1/chat/completions", {
        method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body), signal: running.signal});
      if (!response.ok) throw await failure(response);
      for await (const event of serverEvents(response)) {
        if (event.error) throw new RequestFailed(`The request failed: ${event.error.message}`);
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const text = choice.delta && choice.delta.content;
          if (text) {
            last = performance.now();
            first = first ?? last;
            chunks++;
            message.content += text;
            renderLast();
          }
          finish = choice.finish_reason || finish;
        }
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else {
        message.error = e.message;
        banner(e.message);
      }
    } finally {
      running = null;
      setRunning(false);
    }
    const tokens = usage ? usage.completion_tokens : chunks;
    message.stats = {
      tokens, counted: usage ? "usage" : "chunks", prompt_tokens: usage ? usage.prompt_tokens : null,
      first_token_s: first === null ? null : (first - started) / 1000,
      tokens_per_s: tokens > 1 && last > first ? (tokens - 1) / ((last - first) / 1000) : null, finish};
    delete message.pending;
    saveConversation();
    render();
  }

  // The JSON of each `data:` event of a server-sent event stream, up to [DONE].
  async function* serverEvents(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  // ---- the conversation on the page ----

  function setRunning(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    document.body.classList.toggle("running", on);
  }

  function render() {
    const list = $("messages");
    list.replaceChildren(...conversation.messages.map(messageNode));
    list.scrollTop = list.scrollHeight;
  }

  let frame = 0;
  function renderLast() {  // at most once a frame while a reply streams
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      const list = $("messages");
      const index = conversation.messages.length - 1;
      if (index >= 0) list.lastElementChild?.replaceWith(messageNode(conversation.messages[index], index));
      list.scrollTop = list.scrollHeight;
    });
  }

  function button(text, title, onclick) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = text;
    b.title = title;
    b.className = text.toLowerCase();
    b.onclick = onclick;
    return b;
  }

  function messageNode(m, index) {
    const node = document.createElement("article");
    node.className = `message ${m.role}${m.pending ? " pending" : ""}`;
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = m.role === "user" ? "You" : (m.model || "assistant");
    const content = document.createElement("div");
    content.className = "content";
    if (m.role === "assistant") content.append(renderMarkdown(m.content));
    else content.textContent = m.content;
    node.append(role, content);
    if (m.error) {
      const error = document.createElement("div");
      error.className = "error";
      error.textContent = m.error;
      node.append(error);
    }
    if (m.stats) {
      const meta = document.createElement("div");
      meta.className = "stats";
      meta.textContent = statsText(m.stats);
      node.append(meta);
    }
    if (!m.pending && !running) node.append(actions(m, index));
    return node;
  }

  function statsText(s) {
    const parts = [`${s.tokens} tokens${s.counted === "chunks" ? " (counted as chunks)" : ""}`];
    if (s.tokens_per_s !== null) parts.push(`${s.tokens_per_s.toFixed(1)} tokens/s`);
    if (s.prompt_tokens !== null) parts.push(`prompt ${s.prompt_tokens} tokens`);
    if (s.first_token_s !== null) parts.push(`first token ${s.first_token_s.toFixed(2)} s`);
    if (s.finish) parts.push(s.finish === "length" ? "cut at max tokens" : s.finish);
    return parts.join(" · ");
  }

  function actions(m, index) {
    const bar = document.createElement("div");
    bar.className = "actions";
    if (m.role === "user") bar.append(button("Edit", "edit this message and send it again", () => edit(index)));
    if (m.role === "assistant") {
      bar.append(button("Copy", "copy the reply's text", () => navigator.clipboard.writeText(m.content)));
      if (index === conversation.messages.length - 1) bar.append(button("Regenerate", "ask for this reply again", regenerate));
    }
    return bar;
  }

  function edit(index) {
    const node = $("messages").children[index];
    const box = document.createElement("textarea");
    box.className = "edit-box";
    box.value = conversation.messages[index].content;
    const bar = document.createElement("div");
    bar.className = "actions";
    bar.append(button("Send", "replace the message, drop what followed and ask again", () => {
      if (!box.value.trim()) return;
      conversation.messages[index].content = box.value;
      conversation.messages.length = index + 1;
      saveConversation();
      reply();
    }), button("Cancel", "keep the message as it was", render));
    node.querySelector(".content").replaceChildren(box);
    node.querySelector(".actions").replaceWith(bar);
    box.focus();
  }

  function regenerate() {
    if (running) return;
    const messages = conversation.messages;
    if (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
    reply();
  }

  function send(event) {
    event.preventDefault();
    const text = $("input").value;
    if (running || !text.trim()) return;
    $("input").value = "";
    conversation.messages.push({role: "user", content: text});
    saveConversation();
    reply();
  }

  function banner(text) {
    $("banner").textContent = text;
    $("banner").hidden = false;
  }

  function clearBanner() {
    $("banner").hidden = true;
  }

  function exportConversation() {
    const data = {...conversation, exported: new Date().toISOString(), settings: {...settings, extra: undefined},
                  messages: conversation.messages.filter((m) => !m.pending)};
    const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], {type: "application/json"}));
    const a = document.createElement("a");
    a.href = url;
    a.download = `ferrum-chat-${data.created.slice(0, 19).replace(/:/g, "-")}.json`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  // ---- settings ----

  const FIELDS = {temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed"};

  function openSettings() {
    $("system-prompt").value = settings.system;
    for (const [name, id] of Object.entries(FIELDS)) $(id).value = settings[name] ?? "";
    $("extra-json").value = settings.extra;
    $("settings-error").hidden = true;
    $("key-state").textContent = localStorage.getItem(STORE.key) ? "An API key is kept in this browser." : "No API key kept.";
    $("forget-key").hidden = !localStorage.getItem(STORE.key);
    $("settings").showModal();
  }

  function saveSettings(event) {
    const next = {...settings, system: $("system-prompt").value, extra: $("extra-json").value};
    for (const [name, id] of Object.entries(FIELDS)) {
      const input = $(id);
      next[name] = input.value === "" ? null : Number(input.value);
    }
    const problem = settingsProblem(next);
    if (problem) {
      event.preventDefault();
      $("settings-error").textContent = problem;
      $("settings-error").hidden = false;
      return;
    }
    settings = next;
    localStorage.setItem(STORE.settings, JSON.stringify(settings));
  }

  function settingsProblem(s) {
    for (const [name, id] of Object.entries(FIELDS)) {
      if (!$(id).checkValidity()) return `${$(id).parentNode.textContent.trim()}: ${$(id).validationMessage}`;
      if (s[name] !== null && !Number.isFinite(s[name])) return `${name} must be a number`;
    }
    if (!s.extra.trim()) return null;
    try {
      const extra = JSON.parse(s.extra);
      if (typeof extra !== "object" || extra === null || Array.isArray(extra)) return "Extra request fields must be a JSON object.";
    } catch (e) {
      return `Extra request fields are not JSON: ${e.message}`;
    }
    return null;
  }

  function resetSettings() {
    const model = settings.model;
    settings = {...DEFAULTS, model};
    localStorage.setItem(STORE.settings, JSON.stringify(settings));
    openSettings();
  }

  // ---- wiring ----

  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").onclick = () => running && running.abort();
  $("new-chat").onclick = () => {
    if (running) running.abort();
    conversation = newConversation();
    saveConversation();
    render();
  };
  $("export").onclick = exportConversation;
  $("open-settings").onclick = openSettings;
  $("settings-form").addEventListener("submit", saveSettings);
  $("reset-settings").onclick = resetSettings;
  $("forget-key").onclick = () => {
    localStorage.removeItem(STORE.key);
    openSettings();
  };
  $("key-cancel").onclick = () => $("key-dialog").close("");
  $("model-select").onchange = (e) => {
    settings.model = e.target.value;
    localStorage.setItem(STORE.settings, JSON.stringify(settings));
  };

  // A reply that was streaming when the page went away is kept as far as it came.
  for (const m of conversation.messages) delete m.pending;
  render();
  loadModels();
})();
