// prefixserve cache inspector: renders the `summary` events of GET /inspector/events (the JSON of
// GET /v1/cache/summary) as numbers, inline-SVG charts, a prefix tree and a table of recent cache
// reports. Plain JS, no framework. Every string that comes from the server (tenant names, request
// ids, prefix text, reasons) reaches the page through textContent or a numeric attribute, never
// as markup: tenant names and prompt text are chosen by whoever sends requests.
"use strict";

(function () {
  const EVENTS_URL = "/inspector/events";
  const MAX_POINTS = 300; // ~5 minutes of 1 s updates
  const MAX_TREE_NODES = 1000; // the server bounds the tree too
  const RETRY_MS = 5000;
  const STALE_MS = 10000;
  const SVG_NS = "http://www.w3.org/2000/svg";

  // The reason vocabulary (docs: issue 29); unknown reasons from a newer server still show.
  const REASON_COLORS = {
    not_full_block: "#9aa5b1",
    last_token_rule: "#c3cfd9",
    never_seen: "#4c78a8",
    evicted: "#e45756",
    disk_load_skipped: "#f58518",
    expired: "#b279a2",
    in_flight_wait: "#72b7b2",
    cache_disabled: "#54a24b",
    salt_or_tenant: "#eeca3b",
    adapter: "#ff9da6",
    other_kv_dtype: "#9d755d",
    tier_fault: "#d62728",
  };
  const EXTRA_COLORS = ["#bab0ac", "#439894", "#83bcb6", "#d67195"];
  const TENANT_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#72b7b2", "#eeca3b",
    "#ff9da6", "#9d755d", "#e45756", "#439894"];

  const state = {
    es: null,
    retryTimer: null,
    lastEventAt: 0,
    hitRate: [], // {t, v} with v null when the window saw no request
    missDeltas: [], // {t, counts: {reason: n}}
    prevMiss: null,
    cumulativeMiss: null, // the latest cumulative counts, for the legend
    reasons: Object.keys(REASON_COLORS),
    closed: new Set(), // tree nodes the operator collapsed, by hash, kept across updates
  };

  // ---- small DOM helpers (text only)
  function $(id) {
    return document.getElementById(id);
  }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function isNum(x) {
    return typeof x === "number" && Number.isFinite(x);
  }

  function pct(x) {
    return isNum(x) ? (x * 100).toFixed(1) + "%" : "—";
  }

  function int(x) {
    return isNum(x) ? Math.round(x).toLocaleString("en-US") : "—";
  }

  function count(x, noun) {
    return int(x) + " " + noun + (x === 1 ? "" : "s");
  }

  function bytes(x) {
    if (!isNum(x)) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = x;
    let i = 0;
    while (v >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return (i === 0 ? String(v) : v.toFixed(1)) + " " + units[i];
  }

  function ago(s) {
    if (!isNum(s)) return "—";
    if (s < 60) return s.toFixed(1) + " s ago";
    if (s < 3600) return (s / 60).toFixed(1) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  }

  // Sets the text and a machine-readable data-value (the raw number, "" for none) of #id.
  function setValue(id, raw, text) {
    const node = $(id);
    if (!node) return;
    node.textContent = text;
    node.dataset.value = raw === null || raw === undefined ? "" : String(raw);
  }

  function colorOfReason(reason) {
    if (REASON_COLORS[reason]) return REASON_COLORS[reason];
    let h = 0;
    for (const c of String(reason)) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    return EXTRA_COLORS[h % EXTRA_COLORS.length];
  }

  function colorOfTenant(tenant, index) {
    if (tenant === null || tenant === undefined) return "#8a94a6";
    return TENANT_COLORS[index % TENANT_COLORS.length];
  }

  function tenantLabel(tenant) {
    return tenant === null || tenant === undefined ? "(no tenant)" : String(tenant);
  }

  // ---- connection
  function setStatus(stateName, text) {
    const node = $("status");
    node.dataset.state = stateName;
    node.textContent = text;
  }

  // EventSource hides the HTTP status of a failed connection; ask for it once with fetch (same
  // origin, so the browser sends the operator's credentials the same way) and drop the body.
  async function probeStatus() {
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), 5000);
    try {
      const resp = await fetch(EVENTS_URL, {
        signal: ctrl.signal,
        cache: "no-store",
        headers: { Accept: "text/event-stream" },
      });
      const type = resp.headers.get("content-type") || "";
      ctrl.abort();
      if (!resp.ok) return "error: HTTP " + resp.status + (resp.statusText ? " " + resp.statusText : "");
      if (!type.startsWith("text/event-stream")) return "error: not an event stream (" + type + ")";
      return "error: the event stream closed";
    } catch (err) {
      return "error: server unreachable";
    } finally {
      clearTimeout(timer);
    }
  }

  // (Re)open the event stream. An automatic retry after a refusal keeps the error on show
  // until the stream opens; the reconnect button shows "connecting" at once.
  function connect(retrying) {
    if (state.retryTimer) {
      clearTimeout(state.retryTimer);
      state.retryTimer = null;
    }
    if (state.es) state.es.close();
    if (retrying !== true || $("status").dataset.state !== "error") {
      setStatus("connecting", "connecting…");
    }
    const es = new EventSource(EVENTS_URL);
    state.es = es;
    es.onopen = () => {
      if (state.es === es) setStatus("live", "live");
    };
    es.addEventListener("summary", (ev) => {
      if (state.es !== es) return;
      let summary;
      try {
        summary = JSON.parse(ev.data);
      } catch (err) {
        setStatus("error", "error: a summary was not JSON");
        return;
      }
      state.lastEventAt = Date.now();
      if ($("status").dataset.state !== "live") setStatus("live", "live");
      render(summary);
    });
    es.onerror = async () => {
      if (state.es !== es) return;
      if (es.readyState === EventSource.CONNECTING) {
        // The browser reconnects by itself (network error, server restart).
        setStatus("disconnected", "disconnected, reconnecting…");
        return;
      }
      // CLOSED: a refused or wrong response; EventSource gives up, so we retry ourselves.
      es.close();
      const text = await probeStatus();
      if (state.es !== es) return;
      setStatus("error", text);
      state.retryTimer = setTimeout(() => connect(true), RETRY_MS);
    };
  }

  function watchdog() {
    const node = $("status");
    if (node.dataset.state === "live" && state.lastEventAt &&
        Date.now() - state.lastEventAt > STALE_MS) {
      setStatus("disconnected", "disconnected (no update for " +
        Math.round((Date.now() - state.lastEventAt) / 1000) + " s)");
    }
  }

  // ---- rendering
  function render(s) {
    const upd = new Date(isNum(s.time) ? s.time * 1000 : Date.now());
    $("updated").textContent = upd.toLocaleTimeString();
    renderHeadline(s);
    pushHistory(s);
    drawHitRate();
    drawMissReasons();
    renderPool(s);
    renderTiers(s);
    renderBreakpoints(s.breakpoints);
    renderTree(s.tree);
    renderReports(s.recent_reports || []);
  }

  function renderHeadline(s) {
    const hr = s.hit_rate || {};
    setValue("hit-rate-60s", hr["60s"], pct(hr["60s"]));
    setValue("hit-rate-300s", hr["300s"], pct(hr["300s"]));
    setValue("hit-rate-all", hr.all, pct(hr.all));
    const ev = s.eviction || {};
    setValue("eviction-total", ev.total, int(ev.total));
    setValue("eviction-rate", ev.per_s_60s, isNum(ev.per_s_60s) ? ev.per_s_60s.toFixed(2) : "—");
    const gh = s.ghost || {};
    setValue("ghost-entries", gh.entries, int(gh.entries));
    setValue("ghost-capacity", gh.capacity, int(gh.capacity));
    const pins = s.pins || {};
    setValue("pins-count", pins.count, int(pins.count));
    setValue("pins-blocks", pins.blocks, int(pins.blocks));
    const bp = s.breakpoints || {};
    setValue("cache-writes", bp.write_tokens, int(bp.write_tokens));
    const all = s.all_tokens || {};
    setValue("cache-reads", all.hits, int(all.hits));
    setValue("block-size", s.block_size, int(s.block_size));
    const kv = s.kv_cache || {};
    setValue("kv-dtype", kv.dtype, typeof kv.dtype === "string" ? kv.dtype : "—");
    setValue("kv-bytes-per-token", kv.bytes_per_token, int(kv.bytes_per_token));
  }

  function pushHistory(s) {
    const t = isNum(s.time) ? s.time : Date.now() / 1000;
    const hr = s.hit_rate || {};
    state.hitRate.push({ t, v: isNum(hr["60s"]) ? hr["60s"] : null });
    const cur = s.miss_reasons || {};
    for (const r of Object.keys(cur)) if (!state.reasons.includes(r)) state.reasons.push(r);
    const counts = {};
    let reset = false;
    for (const r of Object.keys(cur)) {
      const before = state.prevMiss ? state.prevMiss[r] || 0 : cur[r];
      const d = (cur[r] || 0) - before;
      if (d < 0) reset = true; // a restarted server: its counters began again
      counts[r] = Math.max(0, d);
    }
    state.missDeltas.push({ t, counts: reset ? {} : counts });
    state.prevMiss = Object.assign({}, cur);
    state.cumulativeMiss = cur;
    while (state.hitRate.length > MAX_POINTS) state.hitRate.shift();
    while (state.missDeltas.length > MAX_POINTS) state.missDeltas.shift();
  }

  // Charts are drawn in pixels: the viewBox follows the element's width, so text is not stretched.
  const CHART_H = 150;
  const MIN_SLOTS = 60;

  function plotArea(node) {
    const w = Math.max(200, Math.round(node.clientWidth || 640));
    node.setAttribute("viewBox", "0 0 " + w + " " + CHART_H);
    return { x0: 44, x1: w - 8, y0: 8, y1: CHART_H - 22 };
  }

  // Clears the chart and draws its y grid, y labels and the time span under the x axis.
  function frame(node, plot, yTicks, spanText) {
    clear(node);
    for (const [frac, label] of yTicks) {
      const y = plot.y1 - frac * (plot.y1 - plot.y0);
      node.appendChild(svg("line", { x1: plot.x0, x2: plot.x1, y1: y, y2: y, class: "grid" }));
      const t = svg("text", { x: plot.x0 - 6, y: y + 4, "text-anchor": "end", class: "tick" });
      t.textContent = label;
      node.appendChild(t);
    }
    const l = svg("text", { x: plot.x0, y: CHART_H - 4, class: "tick" });
    l.textContent = spanText;
    node.appendChild(l);
    const r = svg("text", { x: plot.x1, y: CHART_H - 4, "text-anchor": "end", class: "tick" });
    r.textContent = "now";
    node.appendChild(r);
  }

  // Right-aligned slots, the newest point at the right edge: MIN_SLOTS across at first, growing
  // with the history up to MAX_POINTS.
  function slotWidth(plot, n) {
    return (plot.x1 - plot.x0) / (Math.min(MAX_POINTS, Math.max(MIN_SLOTS, n)) - 1);
  }

  function xOf(plot, i, n) {
    return plot.x1 - (n - 1 - i) * slotWidth(plot, n);
  }

  function spanLabel(points) {
    if (points.length < 2) return "";
    const span = points[points.length - 1].t - points[0].t;
    return span >= 120 ? "−" + (span / 60).toFixed(1) + " min" : "−" + Math.round(span) + " s";
  }

  function drawHitRate() {
    const node = $("chart-hit-rate");
    const plot = plotArea(node);
    const pts = state.hitRate;
    frame(node, plot, [[0, "0%"], [0.5, "50%"], [1, "100%"]], spanLabel(pts));
    let d = "";
    let pen = false;
    let lastXY = null;
    pts.forEach((p, i) => {
      if (p.v === null) {
        pen = false;
        return;
      }
      const x = xOf(plot, i, pts.length);
      const y = plot.y1 - p.v * (plot.y1 - plot.y0);
      d += (pen ? "L" : "M") + x.toFixed(1) + " " + y.toFixed(1);
      pen = true;
      lastXY = [x, y];
    });
    if (d) node.appendChild(svg("path", { d, class: "line" }));
    if (lastXY) node.appendChild(svg("circle", { cx: lastXY[0], cy: lastXY[1], r: 3, class: "dot" }));
    node.dataset.points = String(pts.length);
  }

  function drawMissReasons() {
    const node = $("chart-miss-reasons");
    const plot = plotArea(node);
    const rows = state.missDeltas;
    let max = 1;
    for (const row of rows) {
      let sum = 0;
      for (const r of Object.keys(row.counts)) sum += row.counts[r];
      max = Math.max(max, sum);
    }
    const mid = String(+(max / 2).toFixed(1));
    frame(node, plot, [[0, "0"], [0.5, mid], [1, String(max)]], spanLabel(rows));
    const w = Math.max(1, slotWidth(plot, rows.length) * 0.85);
    const scale = (plot.y1 - plot.y0) / max;
    rows.forEach((row, i) => {
      const x = xOf(plot, i, rows.length) - w / 2;
      let y = plot.y1;
      for (const r of state.reasons) {
        const n = row.counts[r] || 0;
        if (!n) continue;
        const h = n * scale;
        y -= h;
        const rect = svg("rect", { x: x.toFixed(1), y: y.toFixed(1), width: w.toFixed(2),
          height: h.toFixed(1), fill: colorOfReason(r) });
        const title = svg("title");
        title.textContent = r + ": " + n;
        rect.appendChild(title);
        node.appendChild(rect);
      }
    });
    node.dataset.points = String(rows.length);
    // Legend: every reason with its cumulative count.
    const legend = $("miss-legend");
    clear(legend);
    const cum = state.cumulativeMiss || {};
    for (const r of state.reasons) {
      const li = el("li");
      li.dataset.reason = r;
      li.dataset.count = String(cum[r] || 0);
      const sw = el("span", "swatch");
      sw.style.background = colorOfReason(r);
      li.appendChild(sw);
      li.appendChild(el("span", null, r + " "));
      li.appendChild(el("b", null, int(cum[r] || 0)));
      legend.appendChild(li);
    }
  }

  // A horizontal stacked bar of `segments` ({label, value, color}) over `total`.
  function drawBar(node, segments, total) {
    clear(node);
    const vb = node.viewBox.baseVal;
    const W = vb.width;
    const H = vb.height;
    node.appendChild(svg("rect", { x: 0, y: 0, width: W, height: H, class: "track" }));
    let x = 0;
    for (const seg of segments) {
      if (!(seg.value > 0) || !(total > 0)) continue;
      const w = Math.min(W - x, (seg.value / total) * W);
      if (w <= 0) continue;
      const rect = svg("rect", { x: x.toFixed(2), y: 0, width: w.toFixed(2), height: H, fill: seg.color });
      const title = svg("title");
      title.textContent = seg.label + ": " + seg.value;
      rect.appendChild(title);
      node.appendChild(rect);
      x += w;
    }
  }

  function renderPool(s) {
    const pool = s.pool || {};
    setValue("pool-num-blocks", pool.num_blocks, int(pool.num_blocks));
    setValue("pool-in-use", pool.in_use, int(pool.in_use));
    setValue("pool-cached", pool.cached, int(pool.cached));
    setValue("pool-free", pool.free, int(pool.free));
    setValue("pool-pinned", pool.pinned, int(pool.pinned));
    const byTenant = Array.isArray(pool.by_tenant) ? pool.by_tenant : [];
    const segments = byTenant.map((e, i) => ({
      label: tenantLabel(e.tenant), tenant: e.tenant, value: isNum(e.blocks) ? e.blocks : 0,
      color: colorOfTenant(e.tenant, i),
    }));
    const used = segments.reduce((a, b) => a + b.value, 0);
    const total = isNum(pool.num_blocks) ? pool.num_blocks : used;
    const rest = Math.max(0, total - used);
    segments.push({ label: "not cached", value: rest, color: "#e6e9ef", tenant: undefined });
    drawBar($("pool-bar"), segments, total);
    const legend = $("pool-legend");
    clear(legend);
    segments.forEach((seg, i) => {
      const li = el("li");
      if (i < byTenant.length) {
        li.dataset.tenant = seg.tenant === null ? "" : String(seg.tenant);
        li.dataset.blocks = String(seg.value);
      }
      const sw = el("span", "swatch");
      sw.style.background = seg.color;
      li.appendChild(sw);
      li.appendChild(el("span", null, seg.label + " "));
      li.appendChild(el("b", null, int(seg.value)));
      legend.appendChild(li);
    });
  }

  // Clients' held breakpoints: the bounds, then one row per tenant holding any.
  function renderBreakpoints(bp) {
    bp = bp || {};
    setValue("breakpoint-blocks", bp.held_blocks, int(bp.held_blocks));
    setValue("breakpoint-capacity", bp.capacity_blocks, int(bp.capacity_blocks));
    setValue("breakpoint-budget", bp.tenant_budget_blocks, int(bp.tenant_budget_blocks));
    const table = $("breakpoints");
    const body = table.querySelector("tbody");
    clear(body);
    const tenants = bp.tenants && typeof bp.tenants === "object" ? bp.tenants : {};
    const names = Object.keys(tenants).sort((a, b) => (tenants[b].blocks || 0) - (tenants[a].blocks || 0));
    names.forEach((name) => {
      const row = tenants[name] || {};
      const tr = el("tr");
      tr.dataset.tenant = name;
      tr.appendChild(el("td", null, tenantLabel(name === "" ? null : name)));
      tr.appendChild(el("td", "n", int(row.breakpoints)));
      tr.appendChild(el("td", "n", int(row.blocks)));
      tr.appendChild(el("td", "n", int(row.tokens)));
      body.appendChild(tr);
    });
    table.dataset.rows = String(names.length);
  }

  function renderTiers(s) {
    const tiers = s.tiers || {};
    const ram = tiers.ram || {};
    drawBar($("tier-ram-bar"), [{ label: "cached blocks", value: ram.cached_blocks, color: "#4c78a8" }],
      ram.capacity_blocks);
    setValue("tier-ram", ram.cached_blocks,
      int(ram.cached_blocks) + " / " + int(ram.capacity_blocks) + " blocks cached");
    const disk = tiers.disk;
    const row = $("tier-disk-row");
    if (disk && typeof disk === "object") {
      row.dataset.enabled = "true";
      drawBar($("tier-disk-bar"), [{ label: "bytes", value: disk.bytes, color: "#f58518" }],
        disk.capacity_bytes);
      setValue("tier-disk", disk.bytes, bytes(disk.bytes) + " / " + bytes(disk.capacity_bytes) +
        ", " + int(disk.hit_tokens) + " tokens served");
    } else {
      row.dataset.enabled = "false";
      drawBar($("tier-disk-bar"), [], 0);
      setValue("tier-disk", null, "disk tier off");
    }
    renderRemoteTier(tiers.remote);
  }

  // The shared tier (--kv-remote): its counts since start, and whether its latest call
  // reached the server; the bar: blocks it stored against writes it dropped.
  function renderRemoteTier(remote) {
    const row = $("tier-remote-row");
    if (!remote || typeof remote !== "object") {
      row.dataset.enabled = "false";
      row.dataset.connected = "";
      drawBar($("tier-remote-bar"), [], 0);
      setValue("tier-remote", null, "shared tier off");
      return;
    }
    row.dataset.enabled = "true";
    row.dataset.connected = remote.connected ? "true" : "false";
    const stored = isNum(remote.stored_blocks) ? remote.stored_blocks : 0;
    const dropped = isNum(remote.dropped_writes) ? remote.dropped_writes : 0;
    drawBar($("tier-remote-bar"), [
      { label: "stored blocks", value: stored, color: "#54a24b" },
      { label: "dropped writes", value: dropped, color: "#e45756" },
    ], stored + dropped);
    setValue("tier-remote", remote.hit_tokens, (remote.connected ? "connected" : "NOT connected") +
      ", " + int(remote.hit_tokens) + " tokens served, " + int(stored) + " blocks stored, " +
      int(dropped) + " writes dropped, " + int(remote.faults) + " faults, " +
      int(remote.bad_values) + " bad values");
  }

  // ---- the prefix tree: nested lists, a <details> per node with children
  function nodeLine(n) {
    const line = el("span", "node");
    line.appendChild(el("code", "hash", String(n.hash).slice(0, 16)));
    line.appendChild(el("span", "stat", count(n.blocks, "block")));
    line.appendChild(el("span", "stat", count(n.tokens, "token")));
    line.appendChild(el("span", "stat", count(n.hits, "hit")));
    if (n.tenant !== undefined) line.appendChild(el("span", "tenant", tenantLabel(n.tenant)));
    if (isNum(n.last_use_s_ago)) line.appendChild(el("span", "stat muted", ago(n.last_use_s_ago)));
    if (typeof n.text === "string" && n.text) {
      const t = n.text.length > 120 ? n.text.slice(0, 120) + "…" : n.text;
      line.appendChild(el("q", "text", t));
    }
    return line;
  }

  function buildNode(n, budget) {
    const li = el("li");
    li.dataset.hash = String(n.hash);
    li.dataset.blocks = String(isNum(n.blocks) ? n.blocks : 0);
    li.dataset.tokens = String(isNum(n.tokens) ? n.tokens : 0);
    li.dataset.hits = String(isNum(n.hits) ? n.hits : 0);
    if (n.tenant !== undefined) li.dataset.tenant = n.tenant === null ? "" : String(n.tenant);
    budget.used += 1;
    const kids = Array.isArray(n.children) ? n.children : [];
    if (!kids.length) {
      li.appendChild(nodeLine(n));
      return li;
    }
    const det = el("details");
    det.open = !state.closed.has(String(n.hash));
    det.addEventListener("toggle", () => {
      if (det.open) state.closed.delete(String(n.hash));
      else state.closed.add(String(n.hash));
    });
    const sum = el("summary");
    sum.appendChild(nodeLine(n));
    det.appendChild(sum);
    const ul = el("ul");
    for (const k of kids) {
      if (budget.used >= MAX_TREE_NODES) {
        budget.skipped += 1;
        continue;
      }
      ul.appendChild(buildNode(k, budget));
    }
    det.appendChild(ul);
    li.appendChild(det);
    return li;
  }

  function renderTree(tree) {
    const root = $("tree");
    clear(root);
    if (!tree || typeof tree !== "object") {
      root.appendChild(el("p", "muted", "no tree in this summary"));
      root.dataset.nodes = "0";
      return;
    }
    const kids = Array.isArray(tree.children) ? tree.children : [];
    if (!kids.length) {
      root.appendChild(el("p", "muted", "no cached prefixes"));
      root.dataset.nodes = "0";
      return;
    }
    const budget = { used: 0, skipped: 0 };
    const ul = el("ul", "roots");
    for (const k of kids) {
      if (budget.used >= MAX_TREE_NODES) {
        budget.skipped += 1;
        continue;
      }
      ul.appendChild(buildNode(k, budget));
    }
    root.appendChild(ul);
    if (budget.skipped) root.appendChild(el("p", "muted", "… " + budget.skipped + " more subtrees not shown"));
    root.dataset.nodes = String(budget.used);
  }

  // ---- recent reports
  function detailText(detail) {
    if (!detail || typeof detail !== "object") return "";
    return Object.entries(detail)
      .map(([k, v]) => k + "=" + (isNum(v) ? String(+v.toFixed(3)) : typeof v === "string" ? v : JSON.stringify(v)))
      .join(" ");
  }

  function renderReports(reports) {
    const table = $("reports");
    const body = table.tBodies[0];
    clear(body);
    for (const entry of reports) {
      const rep = entry.report || {};
      const tok = rep.tokens || {};
      const tr = el("tr");
      tr.dataset.requestId = String(entry.request_id);
      tr.dataset.reason = String(rep.reason);
      tr.dataset.tenant = entry.tenant === null || entry.tenant === undefined ? "" : String(entry.tenant);
      tr.dataset.hitBlocks = String(rep.hit_blocks);
      tr.dataset.fullBlocks = String(rep.prompt_full_blocks);
      tr.dataset.promptTokens = String(rep.prompt_tokens);
      const when = isNum(entry.time) ? new Date(entry.time * 1000).toLocaleTimeString() : "—";
      tr.appendChild(el("td", "muted", when));
      tr.appendChild(el("td", "mono", entry.request_id));
      tr.appendChild(el("td", null, tenantLabel(entry.tenant)));
      tr.appendChild(el("td", "n", int(tok.ram)));
      tr.appendChild(el("td", "n", int(tok.disk)));
      tr.appendChild(el("td", "n", int(tok.remote)));
      tr.appendChild(el("td", "n", int(tok.computed)));
      tr.appendChild(el("td", "n", int(rep.hit_blocks) + " / " + int(rep.prompt_full_blocks)));
      const reason = el("td", "reason");
      const sw = el("span", "swatch");
      sw.style.background = colorOfReason(rep.reason);
      reason.appendChild(sw);
      reason.appendChild(el("span", null, rep.reason === undefined ? "—" : rep.reason));
      tr.appendChild(reason);
      tr.appendChild(el("td", "mono small", detailText(rep.detail)));
      body.appendChild(tr);
    }
    table.dataset.rows = String(reports.length);
  }

  function start() {
    $("reconnect").addEventListener("click", () => connect(false));
    setInterval(watchdog, 1000);
    connect();
  }

  // For a test or the console: the current state and a way to reconnect.
  window.prefixserveInspector = { reconnect: () => connect(false), state };

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
