// The console's own script: the queues' depth sparklines (uPlot draws them) and showing an
// action's refusal. Everything else is server-rendered HTML that htmx swaps in from the SSE
// feed. No inline script anywhere (the page's Content-Security-Policy allows none).
(function () {
  "use strict";
  var charts = {}; // queue name -> uPlot

  function sparkOptions(el) {
    return {
      width: el.clientWidth || 160,
      height: el.clientHeight || 36,
      cursor: { show: false },
      legend: { show: false },
      select: { show: false },
      scales: { x: { time: true }, y: { range: function (u, min, max) { return [0, Math.max(1, max)]; } } },
      axes: [{ show: false }, { show: false }],
      series: [{}, { stroke: "#2c5fd9", width: 1.5, fill: "rgba(44,95,217,0.12)", points: { show: false } }],
    };
  }

  function draw(history) {
    document.querySelectorAll("div.spark[data-queue]").forEach(function (el) {
      var name = el.getAttribute("data-queue");
      var data = history[name];
      if (!data) { return; }
      var chart = charts[name];
      if (chart && chart.root.parentNode !== el) { chart.destroy(); chart = null; }
      if (!chart) {
        charts[name] = new uPlot(sparkOptions(el), data, el);
      } else {
        chart.setData(data);
      }
    });
  }

  document.addEventListener("htmx:sseMessage", function (event) {
    var message = event.detail;
    if (message && message.type === "history") {
      draw(JSON.parse(message.data));
    }
  });

  // An action refused (4xx): htmx does not swap error answers by default; show the reason.
  document.addEventListener("htmx:responseError", function (event) {
    var note = document.getElementById("action-note");
    var xhr = event.detail.xhr;
    if (note && xhr) {
      var span = document.createElement("span");
      span.className = "note bad";
      span.textContent = "refused (" + xhr.status + "): " + (xhr.responseText || "").replace(/<[^>]*>/g, "");
      note.replaceChildren(span);
    }
  });
})();
