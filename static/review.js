// The review queue's keys: j/k move between sessions, u/d rate the current one, o/Enter open it.
(function () {
  "use strict";
  function rows() { return Array.from(document.querySelectorAll("#review-table tr.review-item")); }
  function current() { return document.activeElement && document.activeElement.closest ? document.activeElement.closest("tr.review-item") : null; }
  function move(step) {
    const all = rows();
    if (!all.length) return;
    const at = all.indexOf(current());
    const next = all[Math.min(all.length - 1, Math.max(0, at < 0 ? 0 : at + step))];
    next.focus();
  }
  document.addEventListener("keydown", function (event) {
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const tag = (event.target.tagName || "").toLowerCase();
    if (tag === "input" || tag === "textarea" || tag === "select") return;
    const row = current();
    if (event.key === "j") { move(1); event.preventDefault(); }
    else if (event.key === "k") { move(-1); event.preventDefault(); }
    else if (row && (event.key === "u" || event.key === "d")) {
      const next = rows()[rows().indexOf(row) + 1];
      row.querySelector("button.thumb." + (event.key === "u" ? "up" : "down")).click();
      if (next) next.focus();
      event.preventDefault();
    } else if (row && (event.key === "o" || event.key === "Enter") && tag !== "button" && tag !== "a") {
      window.location.href = row.dataset.href;
      event.preventDefault();
    }
  });
  document.addEventListener("DOMContentLoaded", function () { const first = rows()[0]; if (first) first.focus(); });
})();
