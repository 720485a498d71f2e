// pass@N grid: clicking a sample cell shows its code and its failing assert or traceback. The grid names
// where to fetch a sample (data-src: the owner's API or a share link's) and where to show it (data-detail).
(function () {
  "use strict";
  function show(box, state, parts) {
    box.setAttribute("data-state", state);
    while (box.firstChild) box.removeChild(box.firstChild);
    parts.forEach(function (p) {
      var el = document.createElement(p[0]);
      if (p[2]) el.className = p[2];
      el.textContent = p[1];
      box.appendChild(el);
    });
  }
  function open(ev) {
    var cell = ev.target.closest && ev.target.closest(".lp-grid .lp-sample[data-problem]");
    if (!cell || cell.dataset.status === "pending") return;
    if (ev.type === "keydown" && ev.key !== "Enter" && ev.key !== " ") return;
    ev.preventDefault();
    var grid = cell.closest(".lp-grid");
    var box = document.getElementById(grid.getAttribute("data-detail") || "");
    if (!box) return;
    grid.querySelectorAll(".lp-sample.lp-picked").forEach(function (c) { c.classList.remove("lp-picked"); });
    cell.classList.add("lp-picked");
    var q = "?problem=" + encodeURIComponent(cell.dataset.problem) + "&greedy=" + cell.dataset.greedy +
      "&index=" + cell.dataset.index;
    var name = cell.dataset.problem + " · " + (cell.dataset.greedy === "1" ? "greedy" : "sample " + cell.dataset.index);
    show(box, "loading", [["h4", name + " · loading…"]]);
    fetch(grid.getAttribute("data-src") + q, { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : Promise.reject(new Error("HTTP " + r.status)); })
      .then(function (s) {
        var head = name + " · " + s.status + (s.runtime_s != null ? " · ran " + s.runtime_s.toFixed(2) + " s" : "") +
          (s.completion_tokens != null ? " · " + s.completion_tokens + " tokens" : "");
        var parts = [["h4", head, "lp-s-" + s.status], ["pre", s.code || "(no code)", "lp-code"]];
        if (s.error) parts.push(["pre", s.error, "lp-trace"]);
        show(box, s.status, parts);
        box.setAttribute("data-problem", cell.dataset.problem);
      })
      .catch(function (e) { show(box, "error", [["h4", name + ": could not load it (" + e.message + ")"]]); });
  }
  document.addEventListener("click", open);
  document.addEventListener("keydown", open);
})();
