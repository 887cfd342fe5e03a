/* The usage page's charts (Plotly, served locally). Data comes from <script type="application/json" id="usage-data">
   (endpoints.usage.views): hourly rows grouped by hour and key or endpoint, and accelerator-hours per hour. */
(function () {
  "use strict";
  var layoutBase = { margin: { l: 55, r: 20, t: 10, b: 45 }, font: { size: 12 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
                     legend: { orientation: "h", y: -0.2 } };
  var config = { displaylogo: false, responsive: true };
  function layout(extra) { return Object.assign({}, layoutBase, extra); }
  /* Plotly renders some HTML in trace names: a key's name shows as typed. */
  function label(value) { return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;"); }

  function hours(rows) {
    var seen = {};
    rows.forEach(function (r) { seen[r.hour] = true; });
    return Object.keys(seen).sort();
  }

  function tokens(el, d) {
    var rows = d.hourly || [];
    if (!rows.length) { el.textContent = "No metered tokens in these days."; return; }
    var by = d.stack, xs = hours(rows), groups = {};
    rows.forEach(function (r) {
      var name = r[by] || "(none)";
      (groups[name] = groups[name] || {})[r.hour] = r.total_tokens;
    });
    var traces = Object.keys(groups).sort().map(function (name) {
      return { type: "bar", name: label(name), x: xs, y: xs.map(function (h) { return groups[name][h] || 0; }) };
    });
    Plotly.newPlot(el, traces, layout({ barmode: "stack", yaxis: { title: { text: "tokens" } } }), config);
  }

  function requests(el, d) {
    var rows = d.hourly || [];
    if (!rows.length) { el.textContent = "No metered requests in these days."; return; }
    var xs = hours(rows), req = {}, err = {};
    rows.forEach(function (r) { req[r.hour] = (req[r.hour] || 0) + r.requests; err[r.hour] = (err[r.hour] || 0) + r.errors; });
    Plotly.newPlot(el, [
      { type: "bar", name: "requests", x: xs, y: xs.map(function (h) { return req[h]; }), marker: { color: "#1d4ed8" } },
      { type: "bar", name: "errors", x: xs, y: xs.map(function (h) { return err[h]; }), marker: { color: "#c8102e" } }
    ], layout({ barmode: "group" }), config);
  }

  function accelerators(el, d) {
    var rows = d.accelerator_hours || [];
    if (!rows.length) { el.textContent = "No replica ran in these days."; return; }
    Plotly.newPlot(el, [
      { type: "bar", name: "accelerator-hours", x: rows.map(function (r) { return r.hour; }), y: rows.map(function (r) { return r.accelerator_hours; }), marker: { color: "#1a7f37" } },
      { type: "scatter", mode: "lines", name: "replica-hours", x: rows.map(function (r) { return r.hour; }), y: rows.map(function (r) { return r.replica_hours; }), line: { color: "#9a6700", shape: "hv" } }
    ], layout({}), config);
  }

  function draw() {
    var el = document.getElementById("usage-data");
    if (typeof Plotly === "undefined" || !el) { return; }
    var d = JSON.parse(el.textContent), kinds = { tokens: tokens, requests: requests, accelerators: accelerators };
    document.querySelectorAll("[data-usage-chart]").forEach(function (c) {
      try { kinds[c.dataset.usageChart](c, d); c.dataset.drawn = "1"; } catch (e) { c.textContent = "Chart failed: " + e; }
    });
  }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", draw); } else { draw(); }
})();
