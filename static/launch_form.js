/* The launch page (templates/endpoints/endpoint_launch.html).
   - Picking a recipe fills the form with its spec. Data: <script type="application/json" id="recipe-data">
     {"recipes": {"name@version": {"spec": {...}, "about": "..."}}, "inputs": {"speculative": {"method":
     "speculative_method", ...}, "compilation": {...}}, "nested": {"roles": {"prefill": {"replicas":
     "prefill_replicas", ...}, "decode": {...}}}, "fillable": [the fields a recipe may set]}.
     The fields a recipe may set are cleared first, so nothing of a recipe picked before stays.
   - The adapters' multi-select lists the chosen artifact's model's alone.
   - "Copy" beside a command of the "Show command" fragment: the clipboard, or else the text selected. */
(function () {
  "use strict";

  function data() {
    var el = document.getElementById("recipe-data");
    return el ? JSON.parse(el.textContent) : { recipes: {}, inputs: {}, fillable: [] };
  }

  function asText(name, value) {
    if (value === null || value === undefined) { return ""; }
    if (name === "async_scheduling") { return value === true ? "on" : value === false ? "off" : ""; }
    if (Array.isArray(value) && value.every(function (v) { return typeof v !== "object"; })) { return value.join(","); }
    if (typeof value === "object") { return JSON.stringify(value); }
    if (name === "restart_daily_at") { return String(value).slice(0, 5); }  // "03:30:00" as HH:MM
    return String(value);
  }

  function setField(form, name, value) {
    var el = form.elements.namedItem(name);
    if (!el) { return; }
    if (el.type === "checkbox") { el.checked = value === true; return; }
    var text = asText(name, value);
    if (el.tagName === "SELECT") {
      var options = Array.prototype.slice.call(el.options);
      if (text === "" && !options.some(function (o) { return o.value === ""; })) {
        el.selectedIndex = 0;  // no blank choice (routing): its first is the default
        return;
      }
      if (!options.some(function (o) { return o.value === text; })) {
        el.add(new Option(text, text));  // a value this page does not list: shown, and the service judges it
      }
    }
    el.value = text;
  }

  function fill(form, d, spec) {
    d.fillable.forEach(function (name) { setField(form, name, null); });
    Object.keys(spec).forEach(function (key) {
      var value = spec[key];
      var inputs = d.inputs[key];
      var nested = (d.nested || {})[key];
      if (nested && value && typeof value === "object") {  // roles: each role's keys to that role's inputs
        Object.keys(value).forEach(function (part) {
          var fields = nested[part] || {};
          Object.keys(value[part] || {}).forEach(function (k) {
            if (fields[k]) { setField(form, fields[k], value[part][k]); }
          });
        });
      } else if (inputs && value && typeof value === "object") {  // a config: its common keys to their own inputs
        var rest = {};
        Object.keys(value).forEach(function (k) {
          if (inputs[k]) { setField(form, inputs[k], value[k]); } else { rest[k] = value[k]; }
        });
        setField(form, key, Object.keys(rest).length ? rest : null);
      } else {
        setField(form, key, value);
      }
    });
  }

  // The adapters of the chosen artifact's model alone (each option's data-model); others are unticked and hidden.
  function showAdapters(form) {
    var artifact = form.elements.namedItem("artifact");
    var adapters = form.elements.namedItem("adapters");
    if (!artifact || !adapters || artifact.selectedIndex < 0) { return; }
    var model = artifact.options[artifact.selectedIndex].dataset.model;
    Array.prototype.forEach.call(adapters.options, function (o) {
      var other = o.dataset.model && model && o.dataset.model !== model;
      o.hidden = !!other;
      if (other) { o.selected = false; }
    });
  }

  function init() {
    var form = document.getElementById("launch-form");
    if (!form) { return; }
    var d = data();
    var artifactSelect = form.elements.namedItem("artifact");
    if (artifactSelect) { artifactSelect.addEventListener("change", function () { showAdapters(form); }); }
    showAdapters(form);
    var picker = form.elements.namedItem("recipe");
    var about = document.getElementById("recipe-about");
    if (picker) {
      picker.addEventListener("change", function () {
        var recipe = d.recipes[picker.value];
        if (about) { about.textContent = recipe ? recipe.about : ""; }
        if (recipe) { fill(form, d, recipe.spec); }
      });
    }
    // The "Show command" answer came in: take the focus to its heading (screen readers read where it went).
    document.body.addEventListener("htmx:afterSwap", function (event) {
      if (event.detail.target && event.detail.target.id === "launch-preview") {
        var heading = document.getElementById("preview-heading");
        if (heading) { heading.focus(); }
      }
    });
  }

  function selectText(el) {
    var range = document.createRange();
    range.selectNodeContents(el);
    var selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest ? event.target.closest("[data-copy]") : null;
    if (!button) { return; }
    var pre = document.getElementById(button.dataset.copy);
    var status = button.parentNode.querySelector(".copy-status");
    if (!pre) { return; }
    function say(text) { if (status) { status.textContent = text; } }
    function fallback() {
      selectText(pre);
      var copied = false;
      try { copied = document.execCommand("copy"); } catch (e) { copied = false; }
      say(copied ? "Copied." : "Selected: press Ctrl+C (⌘C) to copy.");
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(pre.textContent).then(function () { say("Copied."); }, fallback);
    } else {
      fallback();
    }
  });

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
