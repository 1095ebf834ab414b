// The BatchGen dashboard: polls the server's own API and draws what it answers.
// Plain JavaScript, no build step and nothing fetched from elsewhere. The page arrives with the
// server's state in it (the #snapshot JSON, and the same as text), drawn at once, then polled. With API keys configured,
// /v1/* answers 401 without one: the page then asks for a key, keeps it in sessionStorage (this
// tab only) and sends it as "Authorization: Bearer KEY" on every call.
"use strict";

(() => {
  const POLL_MS = 1500;
  const PLOT_SECONDS = 300; // the plots show the last five minutes
  const ANSWER_WORDS = 12; // the words of an answer shown in a result's summary
  const PAGE_SIZE = 20;
  const RESULT_LINES = 5;
  const RESULT_BYTES = 16384; // the tail of the output file fetched with a Range request
  const KEY_ITEM = "batchgen.apiKey";
  const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);
  const CANCELLABLE = new Set(["validating", "in_progress"]);

  const $ = (id) => document.getElementById(id);

  // --- the API, with the key --------------------------------------------------------------------

  let keyPrompt = null; // the one pending prompt every 401 waits on

  function askForKey(message) {
    if (keyPrompt) return keyPrompt;
    keyPrompt = new Promise((resolve) => {
      const dialog = $("key-prompt");
      $("key-message").textContent =
        message || "This server asks for an API key. It is kept in this browser tab only.";
      $("key-input").value = "";
      $("key-form").onsubmit = (event) => {
        event.preventDefault();
        const key = $("key-input").value.trim();
        if (!key) return;
        sessionStorage.setItem(KEY_ITEM, key);
        dialog.close();
        keyPrompt = null;
        showKeyButton();
        resolve();
      };
      dialog.addEventListener("cancel", (event) => event.preventDefault()); // no way past it
      if (!dialog.open) dialog.showModal();
      $("key-input").focus();
    });
    return keyPrompt;
  }

  async function api(path, options = {}) {
    for (;;) {
      const headers = new Headers(options.headers || {});
      const key = sessionStorage.getItem(KEY_ITEM);
      if (key) headers.set("Authorization", `Bearer ${key}`);
      const response = await fetch(path, { ...options, headers, cache: "no-store" });
      if (response.status !== 401) return response;
      // A 401 speaks of the key this call sent: if another key was entered (or the key dropped)
      // while it was out, it is tried again with what is kept now, never a prompt of its own.
      if (sessionStorage.getItem(KEY_ITEM) !== key) continue;
      if (key !== null) sessionStorage.removeItem(KEY_ITEM);
      await askForKey(key !== null ? "The server refused that key. Enter another one." : "");
    }
  }

  async function apiJSON(path, options) {
    const response = await api(path, options);
    const body = await response.json().catch(() => null);
    if (!response.ok) {
      const message = body && body.error ? body.error.message : `HTTP ${response.status}`;
      const error = new Error(message);
      error.status = response.status;
      error.body = body;
      throw error;
    }
    return body;
  }

  function showKeyButton() {
    $("forget-key").hidden = sessionStorage.getItem(KEY_ITEM) === null;
  }

  // --- formatting -------------------------------------------------------------------------------

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const whole = Math.max(0, Math.round(seconds));
    if (whole < 60) return `${whole}s`;
    const minutes = Math.floor(whole / 60);
    if (minutes < 60) return `${minutes}m${String(whole % 60).padStart(2, "0")}s`;
    return `${Math.floor(minutes / 60)}h${String(minutes % 60).padStart(2, "0")}m`;
  }

  function clock(unixSeconds) {
    if (!unixSeconds) return "–";
    const when = new Date(unixSeconds * 1000);
    const today = new Date().toDateString() === when.toDateString();
    return today ? when.toLocaleTimeString() : when.toLocaleString();
  }

  function number(value, digits = 1) {
    if (value === null || value === undefined) return "–";
    return value >= 100 ? Math.round(value).toLocaleString() : value.toFixed(digits);
  }

  function finishedAt(batch) {
    return batch.completed_at || batch.failed_at || batch.cancelled_at || batch.expired_at || null;
  }

  function element(tag, attributes = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) {
      if (name === "text") node.textContent = value;
      else if (name === "class") node.className = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  // --- health and pools ---------------------------------------------------------------------------

  function drawHealth(body, status) {
    const pill = $("health");
    const state = body && body.status;
    if (state === "healthy") {
      pill.dataset.state = "healthy";
      pill.textContent = "healthy";
    } else {
      const reason = (body && body.reason) || `HTTP ${status}`;
      pill.dataset.state = state === "degraded" ? "degraded" : "unhealthy";
      pill.textContent = `${state === "degraded" ? "degraded" : "unhealthy"}: ${reason}`;
    }
  }

  async function refreshHealth() {
    const response = await api("/health");
    const body = await response.json().catch(() => ({}));
    drawHealth(response.ok ? body : { ...body, status: body.status === "degraded" ? "degraded" : "unhealthy" },
      response.status);
  }

  function fillTo(fill, share) {
    fill.style.width = `${(Math.max(0, Math.min(1, share)) * 100).toFixed(1)}%`;
  }

  function gauge(fillId, textId, used, capacity, noun) {
    const share = capacity > 0 ? Math.min(1, used / capacity) : 0;
    const fill = $(fillId);
    fillTo(fill, share);
    fill.dataset.level = share >= 0.8 ? "high" : share >= 0.5 ? "mid" : "low";
    $(textId).textContent = `${used.toLocaleString()} of ${capacity.toLocaleString()} ${noun}`;
  }

  // The engine: what it is computing versus what was admitted to a slot and waits for it. Only
  // the backends can tell the first, each for its own model (engines[].running). When every one
  // can, the server sums them (engine_running, engine_waiting); when some cannot, the page sums
  // those that can and names the others; when none can, it says only "admitted".
  const known = (value) => value !== null && value !== undefined;

  function engineText(pool) {
    const admitted = pool.scheduling_pool_active.toLocaleString();
    const slots = `slots: ${pool.scheduling_pool_capacity.toLocaleString()}`;
    if (known(pool.engine_running) && known(pool.engine_waiting)) {
      return `running on the engine: ${pool.engine_running.toLocaleString()} · admitted, waiting for the ` +
        `engine: ${pool.engine_waiting.toLocaleString()} · ${slots}`;
    }
    const engines = Array.isArray(pool.engines) ? pool.engines : [];
    const telling = engines.filter((engine) => known(engine.running));
    if (!telling.length) {
      return `admitted: ${admitted} · ${slots} (this backend cannot tell how many of them its engine is computing)`;
    }
    const running = telling.reduce((sum, engine) => sum + engine.running, 0);
    const each = telling.map((engine) => `${engine.model}: ${engine.running.toLocaleString()}`).join(", ");
    const silent = engines.filter((engine) => !known(engine.running)).map((engine) => engine.model);
    return `running on the engine: ${running.toLocaleString()} (${each}) · admitted: ${admitted} · ${slots} ` +
      `(${silent.join(", ")}: ${silent.length > 1 ? "their backends cannot" : "its backend cannot"} tell ` +
      "how many of its requests the engine is computing; not counted)";
  }

  function engineGauge(pool) {
    const admitted = pool.scheduling_pool_active;
    const capacity = pool.scheduling_pool_capacity;
    const share = (n) => (capacity > 0 ? n / capacity : 0);
    const fill = $("slots-fill");
    const queued = $("waiting-fill");
    const card = $("slots-text").closest(".card");
    const telling = (Array.isArray(pool.engines) ? pool.engines : []).filter((engine) => known(engine.running));
    let running = pool.engine_running;
    if (known(running) && known(pool.engine_waiting)) {
      fillTo(fill, share(running));
      fillTo(queued, share(pool.engine_waiting));
      fill.dataset.level = "low";
      queued.dataset.level = "";
    } else if (telling.length) { // green: what the engines that can tell compute; blue: the rest admitted
      running = Math.min(admitted, telling.reduce((sum, engine) => sum + engine.running, 0));
      fillTo(fill, share(running));
      fillTo(queued, share(admitted - running));
      fill.dataset.level = "low";
      queued.dataset.level = "unknown";
    } else {
      running = null;
      fillTo(fill, share(admitted));
      fillTo(queued, 0);
      fill.dataset.level = "unknown";
      queued.dataset.level = "";
    }
    $("slots-text").textContent = engineText(pool);
    card.dataset.running = known(running) ? String(running) : "";
    card.dataset.waiting = known(pool.engine_waiting) ? String(pool.engine_waiting) : "";
    card.dataset.admitted = String(admitted);
  }

  // --- the throughput plots -------------------------------------------------------------------------

  // The rates are the server's (GET /v1/pool/status: requests_per_second, tokens_per_second),
  // exponentially weighted over rate_time_constant_s; tokens are counted as the engine makes
  // them where the backend reports that (generated_tokens_counted), else as requests finish.
  const series = { tokens: [], requests: [] }; // {t, value}

  function rateNotes(pool) {
    const window = `exponentially weighted over ${Math.round(pool.rate_time_constant_s)} s`;
    const counted = pool.generated_tokens_counted === "as_generated" ? "counted as generated" : "counted as requests finish";
    $("tokens-note").textContent = `${counted}, ${window}`;
    $("requests-note").textContent = `ended requests, ${window}`;
  }

  function addSample(pool) {
    const t = performance.now() / 1000;
    series.tokens.push({ t, value: pool.tokens_per_second || 0 });
    series.requests.push({ t, value: pool.requests_per_second || 0 });
    for (const points of Object.values(series)) {
      while (points.length && points[0].t < t - PLOT_SECONDS) points.shift();
    }
    $("tokens-rate").textContent = number(pool.tokens_per_second || 0);
    $("requests-rate").textContent = number(pool.requests_per_second || 0, 2);
    rateNotes(pool);
    drawPlot($("tokens-plot"), series.tokens, t);
    drawPlot($("requests-plot"), series.requests, t);
  }

  function niceCeiling(value) {
    if (value <= 0) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
    return 10 * power;
  }

  // The value axis's labels, 0 to top in four steps: each as exact as it takes to tell it from the
  // others at any scale (0.000125 ... 1.875M), trailing zeros dropped, thousands as k, M, G, T.
  const UNITS = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"], [1, ""]];

  function tickLabels(top) {
    const step = top / 4;
    return [0, 1, 2, 3, 4].map((i) => {
      const value = (top * i) / 4;
      if (value === 0) return "0";
      const [unit, suffix] = UNITS.find(([size]) => value >= size) || [1, ""];
      let digits = 0;
      while (digits < 15 && Math.abs(Number((value / unit).toFixed(digits)) * unit - value) > step * 1e-3) digits += 1;
      const text = (value / unit).toFixed(digits).replace(/(\.\d*?)0+$/, "$1").replace(/\.$/, "");
      return text + suffix;
    });
  }

  function drawPlot(canvas, points, now) {
    const ratio = window.devicePixelRatio || 1;
    const cssWidth = canvas.clientWidth || canvas.width;
    const cssHeight = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(cssWidth * ratio)) {
      canvas.width = Math.round(cssWidth * ratio);
      canvas.height = Math.round(cssHeight * ratio);
    }
    const context = canvas.getContext("2d");
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    context.clearRect(0, 0, cssWidth, cssHeight);
    const styles = getComputedStyle(canvas);
    const ink = styles.getPropertyValue("--plot-ink").trim() || "#2563eb";
    const grid = styles.getPropertyValue("--plot-grid").trim() || "#e5e7eb";
    const label = styles.getPropertyValue("--plot-label").trim() || "#6b7280";
    const top = niceCeiling(Math.max(0, ...points.map((p) => p.value)));
    const ticks = tickLabels(top);
    context.font = "11px system-ui, sans-serif";
    const left = Math.max(44, ...ticks.map((text) => Math.ceil(context.measureText(text).width) + 10));
    const bottom = cssHeight - 18;
    const width = cssWidth - left - 8;
    const height = bottom - 8;
    context.fillStyle = label;
    context.strokeStyle = grid;
    context.lineWidth = 1;
    for (let i = 0; i <= 4; i += 1) {
      const y = bottom - (height * i) / 4;
      context.beginPath();
      context.moveTo(left, y);
      context.lineTo(left + width, y);
      context.stroke();
      context.fillText(ticks[i], 4, y + 4);
    }
    // The time axis grows with the history, from one minute up to PLOT_SECONDS.
    const history = points.length ? now - points[0].t : 0;
    const span = Math.min(PLOT_SECONDS, Math.max(60, Math.ceil(history / 60) * 60));
    const tick = span / 60 <= 1 ? 15 : 60;
    for (let ago = 0; ago <= span; ago += tick) {
      const x = left + width - (width * ago) / span;
      const text = ago === 0 ? "now" : ago % 60 ? `-${ago}s` : `-${ago / 60}m`;
      context.fillText(text, Math.max(left - 10, x - 12), cssHeight - 4);
    }
    canvas.dataset.ticks = ticks.join(" ");
    canvas.dataset.points = String(points.length);
    canvas.dataset.peak = String(Math.max(0, ...points.map((p) => p.value)));
    if (points.length < 2) return;
    const x = (t) => left + width - ((now - t) / span) * width;
    const y = (value) => bottom - (value / top) * height;
    context.beginPath();
    points.forEach((p, i) => (i ? context.lineTo(x(p.t), y(p.value)) : context.moveTo(x(p.t), y(p.value))));
    context.strokeStyle = ink;
    context.lineWidth = 2;
    context.stroke();
    context.lineTo(x(points[points.length - 1].t), bottom);
    context.lineTo(x(points[0].t), bottom);
    context.closePath();
    context.globalAlpha = 0.12;
    context.fillStyle = ink;
    context.fill();
    context.globalAlpha = 1;
  }

  // --- the replicas (GET /v1/pool/status: replicas, only on a server that is one of several) ---

  function drawReplicas(pool) {
    const reports = pool.replicas;
    $("replicas").hidden = !Array.isArray(reports) || reports.length === 0;
    if ($("replicas").hidden) return;
    const rows = reports.map((report) => {
      // The server marks a replica not reporting once it missed two reports (killed, cut off).
      const reporting = report.reporting !== false;
      const healthy = reporting && Boolean(report.healthy);
      const health = !reporting ? `not reporting (last report ${Math.round(report.seen_s_ago || 0)}s ago)`
        : healthy ? "healthy" : `unhealthy: ${(report.problems || []).join("; ")}`;
      const cells = [
        ["Replica", element("code", {}, String(report.id))],
        ["Health", element("span", { class: `status ${healthy ? "completed" : "failed"}` }, health)],
        ["Shards held", (report.shards_held || 0).toLocaleString()],
        ["Lines committed", (report.lines_committed || 0).toLocaleString()],
        ["Leases lost", (report.leases_lost || 0).toLocaleString()],
        ["Commits refused", (report.commits_refused || 0).toLocaleString()],
        ["Reported", `${Math.round(report.seen_s_ago || 0)}s ago`],
      ];
      const row = element(
        "tr",
        { "data-replica-id": String(report.id) },
        ...cells.map(([label, content]) => element("td", { "data-label": label }, content)),
      );
      if (!reporting) row.dataset.reporting = "false";
      return row;
    });
    $("replica-rows").replaceChildren(...rows);
  }

  function drawPool(pool) {
    gauge("intake-fill", "intake-text", pool.intake_pool_size, pool.intake_pool_capacity, "requests queued");
    engineGauge(pool);
    $("active-batches").textContent = pool.active_batches.toLocaleString();
    drawReplicas(pool);
    addSample(pool);
  }

  async function refreshPool() {
    drawPool(await apiJSON("/v1/pool/status"));
  }

  // --- the batch table ----------------------------------------------------------------------------

  const cursors = [null]; // the `after` of each page seen, the current one last
  let selected = null; // the id of the batch shown in the detail panel

  function progressBar(batch) {
    const counts = batch.request_counts || { total: 0, completed: 0, failed: 0 };
    const total = counts.total || 0;
    const share = (n) => (total > 0 ? `${((100 * n) / total).toFixed(1)}%` : "0%");
    const done = element("span", { class: "done" });
    done.style.width = share(counts.completed);
    const failed = element("span", { class: "failed" });
    failed.style.width = share(counts.failed);
    const cached = (batch.usage && batch.usage.cached_requests) || 0; // answered by the result cache
    const bar = element("div", {
      class: "bar",
      "data-completed": counts.completed,
      "data-failed": counts.failed,
      "data-total": total,
      "data-cached": cached,
      title: `${counts.completed} completed (${cached} from the result cache), ${counts.failed} failed, ${total} in all`,
    }, done, failed);
    const text = `${(counts.completed + counts.failed).toLocaleString()}/${total.toLocaleString()}`;
    let detail = counts.failed ? `${text} (${counts.failed.toLocaleString()} failed)` : text;
    if (cached) detail += ` (${cached.toLocaleString()} from cache)`;
    return element("div", { class: "progress" }, bar, element("small", { text: detail }));
  }

  // A running batch whose pace says it will end after its expires_at: marked "at risk".
  const AT_RISK_TITLE = "at its recent pace this batch ends after it expires";
  function atRiskMark(batch) {
    return batch.at_risk === true ? [element("span", { class: "at-risk", title: AT_RISK_TITLE, text: "at risk" })] : [];
  }

  function batchRow(batch) {
    const row = element("tr", { "data-batch-id": batch.id, "data-status": batch.status });
    if (batch.at_risk === true) row.dataset.atRisk = "true";
    if (batch.id === selected) row.classList.add("selected");
    const rate = batch.requests_per_second;
    row.append(
      element("td", { "data-label": "Batch" }, element("code", { text: batch.id })),
      element("td", { "data-label": "Status" }, element("span", { class: `status ${batch.status}`, text: batch.status }),
        ...atRiskMark(batch)),
      element("td", { "data-label": "Progress" }, progressBar(batch)),
      element("td", { class: "number", "data-label": "Rate",
        text: rate === null || rate === undefined ? "–" : `${number(rate, 2)}/s` }),
      element("td", { class: "number", "data-label": "ETA", text: duration(batch.estimated_seconds_remaining) }),
      element("td", { "data-label": "Created", text: clock(batch.created_at) }),
      element("td", { "data-label": "Finished", text: clock(finishedAt(batch)) }),
    );
    row.addEventListener("click", () => select(batch.id));
    return row;
  }

  let batchesAsked = 0; // only the latest listing asked for is drawn (a page change overtakes a poll)

  async function refreshBatches() {
    const asked = ++batchesAsked;
    const after = cursors[cursors.length - 1];
    const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (after) query.set("after", after);
    const page = await apiJSON(`/v1/batches?${query}`);
    if (asked !== batchesAsked) return;
    drawBatches(page);
  }

  function drawBatches(page) {
    const rows = $("batch-rows");
    if (!page.data.length) {
      rows.replaceChildren(element("tr", {}, element("td", { colspan: "7", class: "muted", text: "no batches yet" })));
    } else {
      // A row whose batch has not changed is left in place, untouched: a poll that redrew it while
      // it is being clicked would swallow the click (the press and the release on different nodes).
      const shown = new Map([...rows.querySelectorAll("tr[data-batch-id]")].map((row) => [row.dataset.batchId, row]));
      const wanted = page.data.map((batch) => {
        const drawn = JSON.stringify(batch);
        const old = shown.get(batch.id);
        if (old && old.dataset.drawn === drawn) return old;
        const row = batchRow(batch);
        row.dataset.drawn = drawn;
        return row;
      });
      const same = wanted.length === rows.children.length && wanted.every((row, i) => rows.children[i] === row);
      if (!same) rows.replaceChildren(...wanted);
    }
    $("older").disabled = !page.has_more;
    $("older").dataset.after = page.last_id || "";
    $("newer").disabled = cursors.length <= 1;
    $("page-label").textContent = `page ${cursors.length}`;
  }

  // --- one batch in detail ------------------------------------------------------------------------

  let resultsSeen = null; // the counts the shown result lines were read at

  function select(batchId) {
    selected = batchId;
    resultsSeen = null;
    $("detail").hidden = false;
    $("detail-id").textContent = batchId;
    $("detail-results").replaceChildren(element("p", { class: "muted", text: "…" }));
    $("detail-notice").textContent = "";
    for (const row of document.querySelectorAll("#batch-rows tr")) {
      row.classList.toggle("selected", row.dataset.batchId === batchId);
    }
    // The panel sits below the table: bring its top into view unless it is already in the upper half.
    const top = $("detail").getBoundingClientRect().top;
    if (top < 0 || top > window.innerHeight / 2) {
      const still = window.matchMedia("(prefers-reduced-motion: reduce)").matches;
      $("detail").scrollIntoView({ block: "start", behavior: still ? "auto" : "smooth" });
    }
    refreshDetail().catch(showProblem);
  }

  const FIELDS = [
    ["status", (b) => b.status],
    ["endpoint", (b) => b.endpoint],
    ["model", (b) => b.model],
    ["requests", (b) => {
      const c = b.request_counts || {};
      const n = (value) => (value || 0).toLocaleString();
      return `${n(c.completed)} completed, ${n(c.failed)} failed, ${n(c.total)} in all`;
    }],
    ["rate", (b) => (b.requests_per_second === null ? "–"
      : `${number(b.requests_per_second, 2)} requests/s (exponentially weighted over about two minutes)`)],
    ["time left", (b) => duration(b.estimated_seconds_remaining)],
    ["expected done", (b) => clock(b.estimated_completion_at)
      + (b.at_risk === true ? ` (at risk: after it expires, ${clock(b.expires_at)})` : "")],
    ["tokens", (b) => (b.usage ? `${b.usage.input_tokens} in, ${b.usage.output_tokens} out` : "–")],
    ["result cache", (b) => (b.usage && b.usage.cached_requests
      ? `${b.usage.cached_requests.toLocaleString()} requests answered from the cache, `
        + `${(b.usage.saved_tokens || 0).toLocaleString()} tokens not computed again`
      : "–")],
    ["prefix cache", (b) => (b.usage && b.usage.prefix_cached_tokens
      ? `${b.usage.prefix_cached_tokens.toLocaleString()} prompt tokens served by the engine's prefix cache`
      : "–")],
    ["input file", (b) => b.input_file_id],
    ["output file", (b) => b.output_file_id || "–"],
    ["error file", (b) => b.error_file_id || "–"],
    ["result order", (b) => (b.output_order === "input"
      ? "input order (the files are rewritten in input order when the batch ends)"
      : "completion order (lines as requests finish)")],
    ["created", (b) => clock(b.created_at)],
    ["started", (b) => clock(b.in_progress_at)],
    ["finished", (b) => clock(finishedAt(b))],
    ["expires", (b) => clock(b.expires_at)],
    ["metadata", (b) => (b.metadata ? JSON.stringify(b.metadata) : "–")],
  ];

  // A retry names the batch it retries (retry_of), and a batch lists its retries: links that open them.
  function batchLink(batchId) {
    const link = element("a", { href: "#", class: "batch-link", "data-batch-link": batchId, text: batchId });
    link.addEventListener("click", (event) => {
      event.preventDefault();
      select(batchId);
    });
    return link;
  }

  function retryLinks(batch) {
    const retries = Array.isArray(batch.retries) ? batch.retries : [];
    const list = retries.length === 0 ? [document.createTextNode("–")]
      : retries.flatMap((id, index) => (index ? [document.createTextNode(", "), batchLink(id)] : [batchLink(id)]));
    return [
      element("dt", { text: "retry of" }),
      element("dd", { "data-field": "retry_of" }, batch.retry_of ? batchLink(batch.retry_of) : "–"),
      element("dt", { text: "retries" }),
      element("dd", { "data-field": "retries" }, ...list),
    ];
  }

  function showErrors(batch) {
    const problems = [];
    if (batch.errors && Array.isArray(batch.errors.data)) {
      for (const e of batch.errors.data) problems.push(`${e.code}: ${e.message}${e.line ? ` (line ${e.line})` : ""}`);
    } else if (batch.error) {
      problems.push(`${batch.error.code}: ${batch.error.message}`);
    }
    $("detail-errors").replaceChildren(...problems.map((text) => element("p", { class: "error", text })));
  }

  async function latestLines(fileId) {
    const response = await api(`/v1/files/${encodeURIComponent(fileId)}/content`, {
      headers: { Range: `bytes=-${RESULT_BYTES}` },
    });
    if (response.status === 416) return []; // nothing written yet
    if (!response.ok) throw new Error(`the output file answered HTTP ${response.status}`);
    const text = await response.text();
    const range = response.headers.get("Content-Range");
    let lines = text.split("\n");
    lines.pop(); // what follows the last newline: nothing, or a line still being written
    if (response.status === 206 && range && !/^bytes 0-/.test(range)) lines = lines.slice(1); // cut into mid-line
    return lines.slice(-RESULT_LINES);
  }

  // One result line: its custom_id, status and the answer's first words; the raw line one click away.
  function answerText(body) {
    if (!body || typeof body !== "object") return "";
    if (Array.isArray(body.choices) && body.choices.length) {
      const choice = body.choices[0];
      if (choice.message) {
        const content = choice.message.content;
        if (typeof content === "string") return content;
        if (Array.isArray(content)) return content.map((part) => part.text || "").join(" ");
        if (choice.message.refusal) return `refused: ${choice.message.refusal}`;
        return "";
      }
      return typeof choice.text === "string" ? choice.text : "";
    }
    if (Array.isArray(body.output)) { // a Responses answer
      return body.output.flatMap((item) => (Array.isArray(item.content) ? item.content : []))
        .map((part) => part.text || "").join(" ");
    }
    if (Array.isArray(body.data) && body.data.length && body.data[0].embedding) {
      const size = body.data[0].embedding.length;
      return `${body.data.length} embedding${body.data.length > 1 ? "s" : ""} of ${size} dimensions`;
    }
    return "";
  }

  function firstWords(text) {
    const words = text.trim().split(/\s+/).filter(Boolean);
    const shown = words.slice(0, ANSWER_WORDS).join(" ");
    return words.length > ANSWER_WORDS || shown.length > 120 ? `${shown.slice(0, 120)}…` : shown;
  }

  function summarize(line) {
    let record;
    try {
      record = JSON.parse(line);
    } catch {
      return { id: "?", status: "unreadable", words: "this line is not JSON" };
    }
    const id = record && record.custom_id !== undefined ? String(record.custom_id) : "?";
    if (record && record.error) {
      return { id, status: "failed", words: `${record.error.code || "error"}: ${record.error.message || ""}` };
    }
    const response = (record && record.response) || {};
    const ok = response.status_code === undefined || response.status_code < 400;
    return { id, status: ok ? "completed" : `HTTP ${response.status_code}`, words: firstWords(answerText(response.body)) };
  }

  function resultItem(line) {
    const found = summarize(line);
    const summary = element("summary", {},
      element("code", { class: "custom-id", text: found.id }),
      element("span", { class: `status ${found.status === "completed" ? "completed" : "failed"}`, text: found.status }),
      element("span", { class: "answer", text: found.words || "(empty answer)" }));
    return element("details", { class: "result", "data-custom-id": found.id, "data-status": found.status },
      summary, element("pre", { class: "raw", text: line }));
  }

  async function refreshDetail() {
    if (!selected) return;
    const batchId = selected;
    let batch;
    try {
      batch = await apiJSON(`/v1/batches/${encodeURIComponent(batchId)}`);
    } catch (error) {
      if (error.status !== 404 || batchId !== selected) throw error;
      $("detail-notice").textContent = "this batch is gone from the server";
      $("cancel-batch").hidden = true;
      return;
    }
    if (batchId !== selected) return;
    $("detail").dataset.status = batch.status;
    const fields = $("detail-fields");
    fields.replaceChildren(...FIELDS.flatMap(([name, show]) => [element("dt", { text: name }), element("dd", { text: show(batch) })]));
    fields.append(...retryLinks(batch));
    showErrors(batch);
    const cancel = $("cancel-batch");
    cancel.hidden = !CANCELLABLE.has(batch.status);
    const counts = batch.request_counts || {};
    const seen = `${counts.completed}/${counts.failed}/${batch.status}`;
    if (seen === resultsSeen) return;
    const results = $("detail-results");
    if (!batch.output_file_id) {
      results.replaceChildren(element("p", { class: "muted", text: "no results yet" }));
    } else {
      const lines = await latestLines(batch.output_file_id);
      if (batchId !== selected) return;
      results.replaceChildren(...(lines.length ? lines.map(resultItem)
        : [element("p", { class: "muted", text: "no results yet" })]));
    }
    resultsSeen = seen;
  }

  async function cancelSelected() {
    if (!selected) return;
    const batchId = selected;
    if (!window.confirm(`Cancel batch ${batchId}? Its queued requests will not run; finished results stay.`)) return;
    try {
      const batch = await apiJSON(`/v1/batches/${encodeURIComponent(batchId)}/cancel`, { method: "POST" });
      $("detail-notice").textContent = `cancel requested: the batch is ${batch.status}`;
    } catch (error) {
      $("detail-notice").textContent = `cancel refused: ${error.message}`;
    }
    await Promise.allSettled([refreshDetail(), refreshBatches()]);
  }

  // --- the loop -----------------------------------------------------------------------------------

  function showProblem(error) {
    const banner = $("offline");
    banner.hidden = false;
    banner.textContent = `Cannot read the server: ${error.message || error}`;
  }

  async function tick() {
    const results = await Promise.allSettled([refreshHealth(), refreshPool(), refreshBatches(), refreshDetail()]);
    const failure = results.find((r) => r.status === "rejected");
    if (failure) {
      showProblem(failure.reason);
    } else {
      $("offline").hidden = true;
      $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    }
    setTimeout(tick, POLL_MS);
  }

  function start() {
    $("older").addEventListener("click", () => {
      cursors.push($("older").dataset.after);
      refreshBatches().catch(showProblem);
    });
    $("newer").addEventListener("click", () => {
      if (cursors.length > 1) cursors.pop();
      refreshBatches().catch(showProblem);
    });
    $("close-detail").addEventListener("click", () => {
      selected = null;
      $("detail").hidden = true;
      for (const row of document.querySelectorAll("#batch-rows tr.selected")) row.classList.remove("selected");
    });
    $("cancel-batch").addEventListener("click", cancelSelected);
    $("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_ITEM);
      showKeyButton();
    });
    showKeyButton();
    drawSnapshot();
    tick();
  }

  // The state the page arrived with: drawn before the first call answers.
  function drawSnapshot() {
    const holder = $("snapshot");
    let snapshot = null;
    try {
      snapshot = holder ? JSON.parse(holder.textContent || "null") : null;
    } catch {
      return;
    }
    if (!snapshot) return;
    drawHealth(snapshot.health, snapshot.healthy ? 200 : 503);
    if (snapshot.pool) drawPool(snapshot.pool);
    if (snapshot.batches) drawBatches(snapshot.batches);
  }

  // What the tests (and anyone at the console) may call to check the page's formatting.
  window.BatchGenDashboard = Object.freeze({ niceCeiling, tickLabels });

  start();
})();
