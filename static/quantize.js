/* The per-layer error chart of a quantized artifact's accuracy report (data from the
 * json_script "layer-errors"; a static file, so the page needs no inline script under the CSP). */
(function () {
  "use strict";
  var data = document.getElementById("layer-errors");
  if (!data || !window.Plotly) { return; }
  var rows = JSON.parse(data.textContent);
  var names = rows.map(function (r) { return r.layer; });
  var traces = [{type: "bar", name: "relative output error", x: names, y: rows.map(function (r) { return r.rel_error; }),
    marker: {color: rows.map(function (r) { return r.float ? "#9ca3af" : "#1d4ed8"; })}}];
  if (rows.some(function (r) { return r.sensitivity !== undefined; })) {
    traces.push({type: "scatter", mode: "markers", name: "estimated effect on the loss", x: names, yaxis: "y2",
      y: rows.map(function (r) { return r.sensitivity === undefined ? null : r.sensitivity; }),
      marker: {color: "#c8102e", size: 6}});
  }
  Plotly.newPlot("layer-error-chart", traces,
    {title: {text: "Per-layer int8 error (grey bars: kept in float)"}, margin: {t: 70, b: 140},
     legend: {orientation: "h", x: 1, xanchor: "right", y: 1.12}, yaxis: {title: {text: "‖ŷ−y‖/‖y‖"}},
     yaxis2: {title: {text: "½·Σ(g·Δy)²"}, overlaying: "y", side: "right", rangemode: "tozero"}},
    {displaylogo: false, responsive: true});
})();
