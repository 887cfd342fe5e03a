/* Evaluation charts (Plotly, served locally). Data: <script type="application/json" id="evaluation-data">
   {"evaluations": [{"id", "title", "results": [{"label", "value", "stderr"}]}]}; error bars are 2·stderr. */
(function () {
  "use strict";
  var config = { displaylogo: false, responsive: true };
  function trace(e) {
    return { type: "bar", name: e.title, x: e.results.map(function (r) { return r.label; }),
             y: e.results.map(function (r) { return r.value; }),
             error_y: { type: "data", visible: true, array: e.results.map(function (r) { return r.stderr === null ? 0 : 2 * r.stderr; }) } };
  }
  function draw() {
    var el = document.getElementById("evaluation-data");
    if (!el || typeof Plotly === "undefined") { return; }
    var d = JSON.parse(el.textContent);
    document.querySelectorAll("[data-evaluation-chart]").forEach(function (node) {
      Plotly.newPlot(node, d.evaluations.map(trace), {
        barmode: "group", margin: { l: 55, r: 20, t: 30, b: 70 }, font: { size: 12 },
        yaxis: { title: { text: "score (error bar: 2·standard error)" }, rangemode: "tozero" },
        legend: { orientation: "h", y: 1.15 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff" }, config);
    });
  }
  document.addEventListener("DOMContentLoaded", draw);
})();
