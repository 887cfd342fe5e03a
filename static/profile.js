/* Profile charts (Plotly, served locally). Data: <script type="application/json" id="profile-data">
   {"profiles": [{"id", "setup", "breakdown": [{"category", "seconds", "share"}], "telemetry": {"series": [...]}}]}. */
(function () {
  "use strict";
  var config = { displaylogo: false, responsive: true };
  var layoutBase = { margin: { l: 170, r: 20, t: 30, b: 45 }, font: { size: 12 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff" };
  function layout(extra) { return Object.assign({}, layoutBase, extra); }
  function pct(share) { return Math.round(share * 1000) / 10; }

  function breakdown(el, d) {
    var rows = (d.profiles[0] || {}).breakdown || [];
    if (!rows.length) { el.textContent = "No breakdown."; return; }
    Plotly.newPlot(el, [{ type: "bar", orientation: "h", y: rows.map(function (r) { return r.category; }),
      x: rows.map(function (r) { return pct(r.share); }), text: rows.map(function (r) { return pct(r.share) + " % · " + r.seconds.toFixed(3) + " s"; }),
      textposition: "auto", marker: { color: "#1d4ed8" } }],
      layout({ xaxis: { title: { text: "share of the traced time, %" }, range: [0, 100] }, yaxis: { autorange: "reversed" } }), config);
  }

  function compare(el, d) {
    var traces = d.profiles.map(function (p) {
      return { type: "bar", orientation: "h", name: p.setup, y: p.breakdown.map(function (r) { return r.category; }),
               x: p.breakdown.map(function (r) { return pct(r.share); }) };
    });
    Plotly.newPlot(el, traces, layout({ barmode: "group", xaxis: { title: { text: "share of the traced time, %" } },
      yaxis: { autorange: "reversed" }, legend: { orientation: "h", y: 1.1 } }), config);
  }

  function telemetry(el, d) {
    var series = ((d.profiles[0] || {}).telemetry || {}).series || [];
    if (!series.length) { el.textContent = "No telemetry points."; return; }
    Plotly.newPlot(el, series.map(function (s) {
      return { type: "scatter", mode: "lines+markers", name: (s.label || s.metric) + (s.unit ? " (" + s.unit + ")" : ""),
               x: s.points.map(function (p) { return new Date(p[0] * 1000); }), y: s.points.map(function (p) { return p[1]; }) };
    }), layout({ margin: { l: 55, r: 20, t: 30, b: 45 }, legend: { orientation: "h", y: 1.15 } }), config);
  }

  function draw() {
    var el = document.getElementById("profile-data");
    if (!el || typeof Plotly === "undefined") { return; }
    var d = JSON.parse(el.textContent);
    var kinds = { breakdown: breakdown, compare: compare, telemetry: telemetry };
    document.querySelectorAll("[data-profile-chart]").forEach(function (node) {
      var fn = kinds[node.dataset.profileChart];
      if (fn) { fn(node, d); }
    });
  }
  document.addEventListener("DOMContentLoaded", draw);
})();
