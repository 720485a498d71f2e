// Laneplay's live meter: draws the per-token latency sparkline from data-latencies and keeps the
// elapsed time ticking between server updates. The server re-renders every .lp-meter element (at most
// ten times a second); this script only decorates what is there, so the data-* attributes stay the truth.
(function () {
  "use strict";
  var RUNNING = { queued: 1, running: 1, loading: 1 };

  function spark(meter) {
    var svg = meter.querySelector("svg.lp-spark");
    if (!svg || svg.getAttribute("data-drawn") === meter.getAttribute("data-latencies")) return;
    var raw = meter.getAttribute("data-latencies") || "";
    var pts = raw ? raw.split(",").map(Number).filter(function (x) { return isFinite(x); }) : [];
    svg.setAttribute("data-drawn", raw);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    if (pts.length < 2) return;
    var sorted = pts.slice().sort(function (a, b) { return a - b; });
    var top = Math.max(sorted[Math.floor(sorted.length * 0.95)] * 1.2, 1e-3);  // a stall does not flatten the rest
    var w = 200, h = 36, step = w / (pts.length - 1), d = "";
    pts.forEach(function (v, i) {
      var y = h - 2 - Math.min(v, top) / top * (h - 4);
      d += (i ? "L" : "M") + (i * step).toFixed(1) + " " + y.toFixed(1);
    });
    var path = document.createElementNS("http://www.w3.org/2000/svg", "path");
    path.setAttribute("d", d);
    path.setAttribute("class", "lp-spark-line");
    svg.appendChild(path);
    var title = document.createElementNS("http://www.w3.org/2000/svg", "title");
    title.textContent = "per-token latency, last " + pts.length + " tokens (median " +
      sorted[Math.floor(sorted.length / 2)].toFixed(1) + " ms)";
    svg.appendChild(title);
  }

  function tick() {  // every 100 ms: at most ten repaints a second
    var now = performance.now();
    document.querySelectorAll(".lp-meter").forEach(function (m) {
      if (!m.__lpSeen || m.__lpSeen.attr !== m.getAttribute("data-elapsed-ms")) {
        m.__lpSeen = { attr: m.getAttribute("data-elapsed-ms"), at: now };
      }
      spark(m);
      if (!RUNNING[m.getAttribute("data-state")]) return;
      var cell = m.querySelector(".lp-elapsed .lp-v");
      if (!cell) return;
      var ms = Number(m.getAttribute("data-elapsed-ms") || 0) + (now - m.__lpSeen.at);
      var text = (ms / 1000).toFixed(1) + " s";
      if (cell.textContent !== text) cell.textContent = text;
    });
  }

  // A new meter from the server gets its sparkline at once (drawing it changes nothing the next time).
  var pending = false;
  new MutationObserver(function () {
    if (pending) return;
    pending = true;
    setTimeout(function () {
      pending = false;
      document.querySelectorAll(".lp-meter").forEach(spark);
    }, 0);
  }).observe(document.documentElement, { childList: true, subtree: true });
  setInterval(tick, 100);
})();

// A resting meter (no request behind it) and the error line follow the engine's state line, which the
// server refreshes every second: `loading` until the engine is ready, then `idle`; an engine that went
// away shows in #error until it is back (a request's own messages are never overwritten).
(function () {
  "use strict";
  var DOWN = { restarting: 1, unreachable: 1, failed: 1, stopped: 1 };
  function follow() {
    var es = document.getElementById("engine-status");
    if (!es) return;
    var state = es.getAttribute("data-state"), detail = es.getAttribute("data-detail") || "";
    document.querySelectorAll(".lp-meter[data-resting]").forEach(function (m) {
      var want = state === "ready" ? "idle" : "loading";
      if (m.getAttribute("data-state") === want) return;
      m.setAttribute("data-state", want);
      var label = m.querySelector(".lp-state");
      if (label) label.textContent = want;
      var note = m.querySelector(".lp-note");
      if (note) note.textContent = want === "loading" ? state + ": " + detail : "";
    });
    var err = document.getElementById("error");
    if (!err) return;
    var mine = err.getAttribute("data-source") === "engine";
    if (DOWN[state] && (mine || !err.textContent.trim())) {
      var text = "The engine is " + state + ": " + detail + (state === "restarting" ? " The app is starting it again." : "");
      if (err.textContent !== text) {
        err.textContent = text;
        err.className = "lp-error";
        err.setAttribute("role", "alert");
        err.setAttribute("data-source", "engine");
      }
    } else if (!DOWN[state] && mine) {
      err.textContent = "";
      err.className = "lp-error-none";
      err.removeAttribute("data-source");
    }
  }
  setInterval(follow, 250);
})();

// "copy" buttons (a share link): a listener here, not an inline handler, which the page's CSP would block.
document.addEventListener("click", function (e) {
  var b = e.target && e.target.closest ? e.target.closest("[data-copy]") : null;
  if (b && navigator.clipboard) navigator.clipboard.writeText(b.getAttribute("data-copy"));
});
