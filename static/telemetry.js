/* Live telemetry charts (Plotly, served locally).
 *
 * Every element with class "tm-chart" is a chart: data-metric (comma-separated metrics),
 * data-node / data-endpoint / data-device / data-gateway-key (filters), data-names (JSON metric -> trace suffix), data-unit,
 * data-scale (multiplier), data-kind="health" (step lines, OK..Critical, Missing) and data-small.
 * Every 5 s, while the tab is visible, each chart asks /api/v1/telemetry/series for the
 * buckets since its last one, merges them, drops what fell out of the range and redraws
 * with Plotly.react. For tests and tools, each chart keeps data-points (points drawn, all
 * traces), data-updates (redraws so far) and data-last (newest bucket, Unix seconds).
 */
(function () {
  "use strict";
  var PERIOD_MS = 5000;
  var RANGES = { "15m": 900, "1h": 3600, "6h": 21600, "24h": 86400, "7d": 604800 };
  var COLORS = ["#1d4ed8", "#c8102e", "#1a7f37", "#9a6700", "#7c3aed", "#0891b2", "#db2777", "#525252",
                "#65a30d", "#ea580c", "#0f766e", "#4f46e5"];
  var HEALTH = ["OK", "Warning", "Alarm", "Critical", "Missing"];
  var range = "1h";
  try { range = window.sessionStorage.getItem("tm-range") || "1h"; } catch (e) { /* private mode */ }
  if (!RANGES[range]) { range = "1h"; }
  var charts = [];
  var timer = null;

  function names(el) {
    if (!el.dataset.names) { return {}; }
    try { return JSON.parse(el.dataset.names); } catch (e) { return {}; }
  }

  function init(el) {
    if (el._tm) { return; }
    el._tm = { traces: {}, order: [], since: null, busy: false, range: range, multi: el.dataset.metric.indexOf(",") >= 0 };
    charts.push(el);
    refresh(el, true);
  }

  function url(el, full) {
    var p = new URLSearchParams({ metric: el.dataset.metric, range: el._tm.range });
    if (el.dataset.node) { p.set("node", el.dataset.node); }
    if (el.dataset.endpoint) { p.set("endpoint", el.dataset.endpoint); }
    if (el.dataset.device) { p.set("device", el.dataset.device); }
    if (el.dataset.gatewayKey) { p.set("gateway_key", el.dataset.gatewayKey); }
    if (!full && el._tm.since !== null) { p.set("since", String(el._tm.since)); }
    return "/api/v1/telemetry/series?" + p.toString();
  }

  function merge(el, data, full) {
    var tm = el._tm;
    var scale = parseFloat(el.dataset.scale || "1");
    var suffix = names(el);
    if (full) { tm.traces = {}; tm.order = []; }
    var keep = data.end - RANGES[tm.range];
    var newest = tm.since;
    var labels = {};
    data.series.forEach(function (s) { labels[s.label] = true; });
    var oneLabel = Object.keys(labels).length === 1;
    data.series.forEach(function (s) {
      var tr = tm.traces[s.id];
      if (!tr) {
        tr = tm.traces[s.id] = { t: [], v: [], name: s.label };
        tm.order.push(s.id);
      }
      // Several metrics of one subject: name the metric; of several subjects: subject and metric.
      tr.name = !tm.multi ? s.label : (oneLabel ? "" : s.label + " ") + (suffix[s.metric] || s.metric);
      // Buckets from data.start on were sent again (the last one may have grown): replace them.
      var cut = tr.t.length;
      while (cut > 0 && tr.t[cut - 1] >= data.start) { cut--; }
      tr.t.length = cut; tr.v.length = cut;
      for (var i = 0; i < s.t.length; i++) {
        tr.t.push(s.t[i]);
        tr.v.push(s.v[i] === null ? null : s.v[i] * scale);
      }
      var drop = 0;
      while (drop < tr.t.length && tr.t[drop] < keep) { drop++; }
      if (drop) { tr.t.splice(0, drop); tr.v.splice(0, drop); }
      if (tr.t.length && (newest === null || tr.t[tr.t.length - 1] > newest)) { newest = tr.t[tr.t.length - 1]; }
    });
    tm.since = newest === null ? null : newest;
  }

  function draw(el, data) {
    var tm = el._tm;
    var small = !!el.dataset.small;
    var health = el.dataset.kind === "health";
    var points = 0;
    var traces = tm.order.map(function (id, i) {
      var tr = tm.traces[id];
      points += tr.t.length;
      return {
        x: tr.t.map(function (t) { return new Date(t * 1000); }), y: tr.v.slice(), name: tr.name,
        type: "scatter", mode: tr.t.length > 1 ? "lines" : "markers",
        line: { width: small ? 1.2 : 1.6, color: COLORS[i % COLORS.length], shape: health ? "hv" : "linear" },
        connectgaps: false,
        hovertemplate: "%{y:.4~g} " + (el.dataset.unit || "") + "<extra>%{fullData.name}</extra>"
      };
    });
    var now = new Date(data.end * 1000);
    var layout = {
      margin: { l: 48, r: 8, t: 6, b: small ? 22 : 28 }, font: { size: small ? 10 : 11 },
      showlegend: traces.length > 1 && !small, legend: { orientation: "h", y: -0.25 },
      xaxis: { type: "date", range: [new Date((data.end - RANGES[tm.range]) * 1000), now], fixedrange: true },
      yaxis: { rangemode: "tozero", fixedrange: true, ticksuffix: el.dataset.unit === "%" ? " %" : "" },
      hovermode: "x unified", paper_bgcolor: "#fff", plot_bgcolor: "#fff", uirevision: tm.range
    };
    if (small) { layout.xaxis.tickformat = tm.range === "7d" ? "%b %d" : "%H:%M"; }
    if (health) {
      layout.yaxis = { tickvals: [0, 1, 2, 3, 4], ticktext: HEALTH, range: [-0.3, 4.3], fixedrange: true };
    }
    if (!traces.length) {
      layout.annotations = [{ text: "no data yet", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5,
                              font: { color: "#6b7280" } }];
    }
    window.Plotly.react(el, traces, layout, { displaylogo: false, displayModeBar: false, responsive: true });
    el.dataset.points = String(points);
    el.dataset.updates = String(parseInt(el.dataset.updates || "0", 10) + 1);
    el.dataset.last = tm.since === null ? "" : String(tm.since);
    el.dataset.range = tm.range;
  }

  function refresh(el, full) {
    var tm = el._tm;
    if (tm.busy || !window.Plotly) { return; }
    if (!document.body.contains(el)) { charts = charts.filter(function (c) { return c !== el; }); return; }
    tm.busy = true;
    var wanted = tm.range;
    var isFull = full || tm.since === null;
    fetch(url(el, isFull), { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) {
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.json();
      })
      .then(function (data) {
        if (wanted !== tm.range) { return; } // the range changed meanwhile: a full load follows
        merge(el, data, isFull);
        draw(el, data);
        el.removeAttribute("data-error");
      })
      .catch(function (err) { el.dataset.error = String(err && err.message || err); })
      .then(function () { tm.busy = false; });
  }

  function tick() {
    if (document.visibilityState === "hidden") { return; } // paused while the tab is hidden
    charts.forEach(function (el) { refresh(el, false); });
  }

  function setRange(value) {
    if (!RANGES[value]) { return; }
    range = value;
    try { window.sessionStorage.setItem("tm-range", value); } catch (e) { /* ignore */ }
    markRange();
    charts.forEach(function (el) {
      el._tm.range = value; el._tm.since = null; el._tm.busy = false;
      refresh(el, true);
    });
  }

  function markRange() {
    document.querySelectorAll(".tm-ranges button").forEach(function (b) {
      b.classList.toggle("active", b.dataset.range === range);
      b.setAttribute("aria-pressed", b.dataset.range === range ? "true" : "false");
    });
  }

  function scan(root) {
    (root || document).querySelectorAll(".tm-chart").forEach(init);
  }

  document.addEventListener("click", function (ev) {
    var b = ev.target.closest && ev.target.closest(".tm-ranges button[data-range]");
    if (b) { setRange(b.dataset.range); }
  });
  document.addEventListener("visibilitychange", function () {
    if (document.visibilityState === "visible") { tick(); }
  });
  document.addEventListener("htmx:load", function (ev) { scan(ev.detail && ev.detail.elt); });
  // Panels marked data-poll-visible-only poll while the tab is visible only. Here, not in an htmx
  // trigger filter ("every 5s[...]"): htmx evaluates those with Function(), which the CSP refuses.
  document.addEventListener("htmx:beforeRequest", function (ev) {
    var elt = ev.detail && ev.detail.elt;
    if (elt && elt.hasAttribute("data-poll-visible-only") && document.visibilityState !== "visible") {
      ev.preventDefault();
    }
  });

  function start() {
    markRange();
    scan(document);
    if (!timer) { timer = window.setInterval(tick, PERIOD_MS); }
  }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", start); } else { start(); }
  window.consoleTelemetry = { refreshAll: tick, setRange: setRange, charts: function () { return charts.slice(); } };
})();
