// The token view (app/tokenview.py): hovering, focusing or clicking a token (.lp-tok) shows the tokens the
// model weighed at its position, with their probabilities (the token's data-top), in one floating box,
// #token-alternatives. Escape, or leaving the tokens, hides it.
(function () {
  function box() {
    var b = document.getElementById("token-alternatives");
    if (!b) {
      b = document.createElement("div");
      b.id = "token-alternatives";
      b.className = "lp-tok-top";
      b.setAttribute("role", "tooltip");
      b.hidden = true;
      document.body.appendChild(b);
    }
    return b;
  }
  function pct(p) { return (100 * p).toFixed(2) + "%"; }
  function show(tok) {
    var top;
    try { top = JSON.parse(tok.getAttribute("data-top") || "[]"); } catch (e) { top = []; }
    var b = box();
    b.textContent = "";
    var head = document.createElement("div");
    head.className = "lp-alt-head";
    var lp = parseFloat(tok.getAttribute("data-logprob"));
    head.textContent = "chosen " + JSON.stringify(tok.textContent) + (isNaN(lp) ? "" : " · " + pct(Math.exp(lp)));
    b.appendChild(head);
    top.forEach(function (a) {
      var row = document.createElement("div");
      row.className = "lp-alt" + (a.token === tok.textContent ? " lp-alt-chosen" : "");
      row.setAttribute("data-token", a.token);
      row.setAttribute("data-p", String(a.p));
      var bar = document.createElement("span");
      bar.className = "lp-alt-bar";
      bar.style.width = Math.max(1, Math.round(60 * a.p)) + "px";
      var name = document.createElement("code");
      name.textContent = JSON.stringify(a.token);
      var val = document.createElement("span");
      val.className = "lp-alt-p";
      val.textContent = pct(a.p);
      row.appendChild(bar);
      row.appendChild(name);
      row.appendChild(val);
      b.appendChild(row);
    });
    var view = tok.closest(".lp-tokview");
    b.setAttribute("data-for", (view ? view.id : "") + ":" + tok.getAttribute("data-i"));
    var r = tok.getBoundingClientRect();
    b.style.left = Math.round(window.scrollX + r.left) + "px";
    b.style.top = Math.round(window.scrollY + r.bottom + 4) + "px";
    b.hidden = false;
  }
  function hide() { var b = document.getElementById("token-alternatives"); if (b) b.hidden = true; }
  function token(e) { return e.target && e.target.closest ? e.target.closest(".lp-tok") : null; }
  ["mouseover", "focusin", "click"].forEach(function (kind) {
    document.addEventListener(kind, function (e) { var t = token(e); if (t) show(t); });
  });
  document.addEventListener("mouseout", function (e) {
    var to = e.relatedTarget;
    if (token(e) && !(to && to.closest && (to.closest(".lp-tok") || to.closest("#token-alternatives")))) hide();
  });
  document.addEventListener("keydown", function (e) { if (e.key === "Escape") hide(); });
})();
