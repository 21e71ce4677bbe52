// The status page: polls status.json every second and renders it. Every value is
// written with textContent (node ids and messages come from operators and logs).
"use strict";

(function () {
  const POLL_MS = 1000;
  const KEY_STORE = "mesh-status-key";
  let key = keyFromFragment() || sessionStorage.getItem(KEY_STORE) || "";
  let timer = null;
  let polling = false;

  function keyFromFragment() {
    const params = new URLSearchParams(window.location.hash.slice(1));
    return params.get("key") || "";
  }

  function $(id) {
    return document.getElementById(id);
  }

  function setText(id, text) {
    $(id).textContent = text;
  }

  function cell(text, numeric) {
    const td = document.createElement("td");
    td.textContent = text;
    if (numeric) td.className = "num";
    return td;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "-";
    if (n < 1024) return n + " B";
    const units = ["KiB", "MiB", "GiB", "TiB"];
    let value = n / 1024;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return value.toFixed(1) + " " + units[unit];
  }

  function ms(value) {
    return value === null || value === undefined ? "-" : value.toFixed(1);
  }

  function duration(seconds) {
    if (!seconds) return "-";
    const s = Math.floor(seconds);
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    const rest = s % 60;
    if (h) return h + "h " + String(m).padStart(2, "0") + "m";
    if (m) return m + "m " + String(rest).padStart(2, "0") + "s";
    return rest + "s";
  }

  function clock(unixSeconds) {
    return new Date(unixSeconds * 1000).toLocaleTimeString();
  }

  function layers(range) {
    return range ? "[" + range[0] + ", " + range[1] + ")" : "-";
  }

  function stateClass(state) {
    if (state === "serving" || state === "alive") return "badge ok";
    if (state === "loading" || state === "waiting") return "badge warn";
    if (state === "failed" || state === "dead" || state === "stalled" || state === "unreachable") return "badge bad";
    return "badge";
  }

  function renderStages(stages) {
    const rows = stages.map(function (stage) {
      const tr = document.createElement("tr");
      const state = document.createElement("td");
      const badge = document.createElement("span");
      badge.className = stateClass(stage.health === "alive" ? stage.state : stage.health);
      badge.textContent = stage.health === "alive" ? stage.state : stage.health + " / " + stage.state;
      state.appendChild(badge);
      tr.append(
        cell(String(stage.index)),
        cell(stage.node_id || "?"),
        cell(stage.address || "-"),
        cell(stage.device || "-"),
        cell(layers(stage.layers)),
        state,
        cell(String(stage.term), true),
        cell(bytes(stage.param_bytes), true),
        cell(stage.memory_bytes ? bytes(stage.memory_bytes) + " " + stage.memory_source : "-", true),
        cell(bytes(stage.kv_bytes), true),
        cell(bytes(stage.prefix_bytes), true),
        cell(stage.sessions === null ? "-" : String(stage.sessions), true),
        cell(ms(stage.planned_step_ms), true),
        cell(ms(stage.step_ms), true),
        cell(ms(stage.queue_ms), true),
        cell(stage.heartbeat_age_s === null ? "-" : stage.heartbeat_age_s.toFixed(1) + " s ago", true)
      );
      return tr;
    });
    document.querySelector("#stages tbody").replaceChildren(...rows);
    $("no-stages").hidden = stages.length > 0;
  }

  function renderSpare(nodes) {
    const rows = nodes.map(function (node) {
      const tr = document.createElement("tr");
      tr.append(
        cell(node.node_id),
        cell(node.address),
        cell(node.device || "-"),
        cell(node.health),
        cell(node.state),
        cell(String(node.term), true),
        cell(node.heartbeat_age_s.toFixed(1) + " s ago", true)
      );
      return tr;
    });
    document.querySelector("#spare-nodes tbody").replaceChildren(...rows);
    $("spare").hidden = nodes.length === 0;
  }

  function renderEvents(events) {
    const items = events.map(function (event) {
      const li = document.createElement("li");
      const time = document.createElement("time");
      time.textContent = clock(event.time);
      const kind = document.createElement("span");
      kind.className = "kind " + event.kind;
      kind.textContent = event.kind;
      const message = document.createElement("span");
      message.textContent = event.message + (event.count > 1 ? " (\u00d7" + event.count + ")" : "");
      li.append(time, kind, message);
      return li;
    });
    document.querySelector("#events ul").replaceChildren(...items);
    $("no-events").hidden = events.length > 0;
  }

  function render(doc) {
    const mesh = doc.mesh;
    const model = doc.model;
    const state = mesh.reachable ? mesh.state : doc.ready ? "serving" : "unknown";
    setText("model-id", model.id || "no model loaded");
    const badge = $("mesh-state");
    badge.textContent = state;
    badge.className = stateClass(state);
    setText("updated", "updated " + clock(doc.generated_at));
    const problems = [];
    if (!mesh.reachable) problems.push("coordinator unreachable: " + mesh.unreachable_reason);
    if (mesh.error) problems.push(mesh.error);
    if (mesh.waiting_for) problems.push("waiting for " + mesh.waiting_for);
    if (!doc.ready && doc.reason) problems.push(doc.reason);
    setText("problem", problems.join(" \u2014 "));

    setText("model", model.id || "-");
    setText("package", model.package || "-");
    setText("weights", model.weights || "-");
    setText("dtype", model.dtype || "-");
    setText("context", model.context_length ? model.context_length + " tokens" : "-");
    setText("layer-count", model.layer_count ? String(model.layer_count) : "-");

    setText("state", state);
    setText("term", String(mesh.term));
    setText("coordinator", mesh.coordinator + (mesh.coordinator_id ? " (" + mesh.coordinator_id + ")" : ""));
    setText("wire-dtype", model.wire_dtype || "-");
    setText("uptime", duration(doc.uptime_s));
    setText("pipeline-uptime", duration(doc.pipeline_uptime_s));

    const throughput = doc.throughput;
    setText("tok-s", throughput.tokens_per_s.toFixed(1) + " tok/s");
    setText("tok-s-window", "generated, over the last " + throughput.window_s + " s");
    setText("tokens-total", String(throughput.tokens_total));
    setText("round-ms", throughput.round_ms === null ? "-" : throughput.round_ms.toFixed(1) + " ms");
    const requests = doc.requests;
    setText("running", requests.running + " of " + requests.max_running);
    setText("queued", requests.queued + " of " + requests.max_queued);
    setText("recoveries", String(requests.recoveries));

    const spec = doc.speculation;
    setText("strategy", spec.strategy || "off");
    setText("policy", spec.policy || "-");
    setText(
      "accept-rate",
      spec.accept_rate === null ? "-" : (100 * spec.accept_rate).toFixed(1) + "%"
    );
    setText("drafted", spec.drafted + " drafted, " + spec.accepted + " accepted in " + spec.windows + " windows");
    setText("notes", spec.notes.length ? spec.notes.join("; ") : "-");

    renderStages(doc.stages);
    renderSpare(doc.spare_nodes);
    renderEvents(doc.events);
    $("board").hidden = false;
  }

  function askForKey(message) {
    setText("key-message", message);
    $("key-prompt").hidden = false;
    $("board").hidden = true;
    const badge = $("mesh-state");
    badge.textContent = "API key needed";
    badge.className = "badge warn";
    $("key-input").focus();
  }

  // One poll at a time; after a 401 polling waits for a key.
  async function poll() {
    timer = null;
    polling = true;
    let again = true;
    try {
      const headers = key ? { Authorization: "Bearer " + key } : {};
      const response = await fetch("status.json", { headers: headers, cache: "no-store" });
      if (response.status === 401) {
        askForKey(
          key
            ? "That API key was refused; enter the mesh's key."
            : "This mesh needs its API key to show its status."
        );
        again = false;
      } else if (!response.ok) {
        throw new Error("HTTP " + response.status);
      } else {
        const doc = await response.json();
        $("key-prompt").hidden = true;
        render(doc);
      }
    } catch (error) {
      setText("problem", "cannot reach stage 0: " + error.message);
      const badge = $("mesh-state");
      badge.textContent = "disconnected";
      badge.className = "badge bad";
    } finally {
      polling = false;
    }
    if (again) timer = setTimeout(poll, POLL_MS);
  }

  $("key-form").addEventListener("submit", function (event) {
    event.preventDefault();
    key = $("key-input").value.trim();
    $("key-input").value = "";
    if (key) sessionStorage.setItem(KEY_STORE, key);
    if (timer !== null) clearTimeout(timer);
    timer = null;
    if (!polling) poll();
  });

  poll();
})();
