/* The tuning page's Pareto chart (Plotly, served locally). Data: <script type="application/json" id="tuning-data">
   {"points": [{"number", "throughput", "p99_ms", "meets", "kind", "label"}], "pareto": [numbers], "best": n,
    "slo": {"ttft_p99_ms", "itl_p99_ms", "min_throughput"}}. */
(function () {
  "use strict";
  function draw() {
    var el = document.getElementById("tuning-data");
    var node = document.getElementById("chart-pareto");
    if (!el || !node || typeof Plotly === "undefined") { return; }
    var d = JSON.parse(el.textContent);
    if (!d.points.length) { node.textContent = "No measured trial yet."; return; }
    function pick(meets) { return d.points.filter(function (p) { return p.meets === meets; }); }
    function trace(points, name, color, symbol) {
      return { type: "scatter", mode: "markers", name: name, x: points.map(function (p) { return p.p99_ms; }),
               y: points.map(function (p) { return p.throughput; }), text: points.map(function (p) { return p.label; }),
               hovertemplate: "%{text}<br>P99 TTFT %{x:.0f} ms<br>%{y:.1f} tok/s<extra></extra>",
               marker: { size: 11, color: color, symbol: symbol } };
    }
    var front = d.points.filter(function (p) { return d.pareto.indexOf(p.number) >= 0; })
      .sort(function (a, b) { return a.p99_ms - b.p99_ms; });
    var traces = [
      trace(pick(true), "meets the SLO", "#15803d", "circle"),
      trace(pick(false), "misses the SLO", "#b91c1c", "x"),
      { type: "scatter", mode: "lines", name: "Pareto front", x: front.map(function (p) { return p.p99_ms; }),
        y: front.map(function (p) { return p.throughput; }), line: { color: "#1d4ed8", dash: "dot" }, hoverinfo: "skip" }
    ];
    var best = d.points.filter(function (p) { return p.number === d.best; });
    if (best.length) { traces.push(trace(best, "best", "#f59e0b", "star")); traces[traces.length - 1].marker.size = 18; }
    var shapes = [], notes = [];
    if (d.slo.ttft_p99_ms) {
      shapes.push({ type: "line", xref: "x", yref: "paper", x0: d.slo.ttft_p99_ms, x1: d.slo.ttft_p99_ms, y0: 0, y1: 1, line: { color: "#b91c1c", dash: "dash" } });
      notes.push({ xref: "x", yref: "paper", x: d.slo.ttft_p99_ms, y: 1, text: "SLO TTFT P99", showarrow: false, yanchor: "bottom" });
    }
    if (d.slo.min_throughput) {
      shapes.push({ type: "line", xref: "paper", yref: "y", x0: 0, x1: 1, y0: d.slo.min_throughput, y1: d.slo.min_throughput, line: { color: "#b91c1c", dash: "dash" } });
      notes.push({ xref: "paper", yref: "y", x: 0, y: d.slo.min_throughput, text: "SLO min throughput", showarrow: false, xanchor: "left", yanchor: "bottom" });
    }
    Plotly.newPlot(node, traces, {
      margin: { l: 60, r: 20, t: 30, b: 50 }, font: { size: 12 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff",
      xaxis: { title: { text: "P99 time to first token, ms" }, rangemode: "tozero" },
      yaxis: { title: { text: "output tokens/s" }, rangemode: "tozero" },
      shapes: shapes, annotations: notes, legend: { orientation: "h", y: 1.15 }
    }, { displaylogo: false, responsive: true });
  }
  document.addEventListener("DOMContentLoaded", draw);
})();
