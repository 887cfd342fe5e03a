/* Benchmark charts (Plotly, served locally). Data comes from the page's
   <script type="application/json" id="bench-data">; each chart is a <div data-bench-chart=...>. */
(function () {
  "use strict";
  function data() {
    var el = document.getElementById("bench-data");
    return el ? JSON.parse(el.textContent) : null;
  }
  var layoutBase = { margin: { l: 55, r: 20, t: 36, b: 45 }, font: { size: 12 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff" };
  var config = { displaylogo: false, responsive: true };
  function layout(extra) { return Object.assign({}, layoutBase, extra); }

  function hist(el, d) {
    var values = d[el.dataset.key] || [];
    if (!values.length) { el.textContent = "No values."; return; }
    var p99 = (d.p99 || {})[el.dataset.key];
    var shapes = p99 == null ? [] : [{ type: "line", x0: p99, x1: p99, yref: "paper", y0: 0, y1: 1, line: { color: "#c8102e", dash: "dot" } }];
    Plotly.newPlot(el, [{ type: "histogram", x: values, marker: { color: "#1d4ed8" }, nbinsx: 40, name: "requests" }],
      layout({ title: { text: el.dataset.title }, xaxis: { title: { text: "ms" } }, yaxis: { title: { text: "count" } }, shapes: shapes,
               annotations: p99 == null ? [] : [{ x: p99, yref: "paper", y: 1, text: "P99", showarrow: false, font: { color: "#c8102e" } }] }), config);
  }

  function timeline(el, d) {
    var t = d.timeline || {};
    if (!t.t || !t.t.length) { el.textContent = "No timeline."; return; }
    Plotly.newPlot(el, [
      { x: t.t, y: t.output_tps, type: "scatter", mode: "lines", name: "output tokens/s", line: { color: "#1d4ed8", shape: "hv" } },
      { x: t.t, y: t.rps, type: "scatter", mode: "lines", name: "completed requests/s", yaxis: "y2", line: { color: "#1a7f37", shape: "hv" } },
      { x: t.t, y: t.in_flight, type: "scatter", mode: "lines", name: "requests in flight", yaxis: "y2", line: { color: "#9a6700", dash: "dot", shape: "hv" } }
    ], layout({ xaxis: { title: { text: "seconds since the first request (bins of " + t.bin_s + " s)" } },
                yaxis: { title: { text: "tokens/s" } }, yaxis2: { title: { text: "requests" }, overlaying: "y", side: "right" },
                legend: { orientation: "h", y: 1.12 } }), config);
  }

  function sweep(el, points) {
    var ok = points.filter(function (p) { return p[el.dataset.x] != null && p[el.dataset.y] != null; });
    if (!ok.length) { el.textContent = "No finished levels yet."; return; }
    Plotly.newPlot(el, [{
      x: ok.map(function (p) { return p[el.dataset.x]; }), y: ok.map(function (p) { return p[el.dataset.y]; }),
      text: ok.map(function (p) { return "c=" + p.max_concurrency; }), type: "scatter", mode: "lines+markers+text",
      textposition: "top left", marker: { size: 9, color: "#1d4ed8" }
    }], layout({ xaxis: { title: { text: el.dataset.xtitle } }, yaxis: { title: { text: el.dataset.ytitle } } }), config);
  }

  function bar(el, d) {
    var values = d[el.dataset.key] || [];
    if (!values.some(function (v) { return v != null; })) { el.textContent = "No values."; return; }
    Plotly.newPlot(el, [{ type: "bar", x: d.labels, y: values, marker: { color: "#1d4ed8" },
      text: values.map(function (v) { return v == null ? "" : (Math.round(v * 1000) / 1000).toString(); }), textposition: "auto" }],
      layout({ title: { text: el.dataset.title }, xaxis: { automargin: true, tickangle: -20 } }), config);
  }

  function draw() {
    if (typeof Plotly === "undefined") { return; }
    var d = data();
    if (d == null) { return; }
    document.querySelectorAll("[data-bench-chart]").forEach(function (el) {
      var kind = el.dataset.benchChart;
      try {
        if (kind === "hist") { hist(el, d); }
        else if (kind === "timeline") { timeline(el, d); }
        else if (kind === "sweep") { sweep(el, d); }
        else if (kind === "bar") { bar(el, d); }
      } catch (err) { el.textContent = "Chart failed: " + err; }
    });
  }
  var ENDED = ["succeeded", "failed", "cancelled"];
  var sweepWasActive = false;
  document.addEventListener("DOMContentLoaded", function () {
    var live = document.getElementById("sweep-live");
    sweepWasActive = !!live && ENDED.indexOf(live.dataset.state) < 0;
    draw();
  });
  // A sweep page redraws its curve once the sweep ends (its table is refreshed by htmx).
  document.addEventListener("htmx:afterSettle", function () {
    var live = document.getElementById("sweep-live");
    if (sweepWasActive && live && ENDED.indexOf(live.dataset.state) >= 0) { window.location.reload(); }
  });
})();
