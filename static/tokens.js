// The session page's token card: hover a token, or focus a token block (Tab) and move with
// the arrow keys, to see its text, id, logprob and policy version. One card for the page;
// events are delegated, so tokens swapped in by htmx polling work too.
(function () {
  const card = document.createElement("div");
  card.id = "tok-card";
  card.setAttribute("role", "tooltip");
  card.hidden = true;
  document.body.appendChild(card);

  const visible = (text) => text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "(part of the previous character)";

  function row(label, value) {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = label;
    dd.textContent = value;
    return [dt, dd];
  }

  let current = null;  // the token the card describes

  function show(tok) {
    current = tok;
    const text = document.createElement("div");
    text.className = "tok-card-text";
    text.textContent = visible(tok.textContent);
    const facts = document.createElement("dl");
    facts.append(...row("id", tok.dataset.id));
    if (tok.dataset.signal !== undefined) {
      facts.append(...row("hint signal", `${Number(tok.dataset.signal).toFixed(4)}  (teacher − student)`));
    } else if (tok.classList.contains("prompt")) {
      facts.append(...row("kind", "prompt token"));
    } else {
      const lp = Number(tok.dataset.lp);
      facts.append(...row("logprob", `${lp.toFixed(4)}  (p = ${(Math.exp(lp) * 100).toFixed(1)}%)`));
      facts.append(...row("version", `v${tok.dataset.version}`));
    }
    card.replaceChildren(text, facts);
    card.hidden = false;
    const r = tok.getBoundingClientRect(), c = card.getBoundingClientRect();
    const left = Math.min(Math.max(8, r.left), window.innerWidth - c.width - 8);
    const below = r.bottom + 6 + c.height < window.innerHeight;
    card.style.left = `${left}px`;
    card.style.top = `${below ? r.bottom + 6 : r.top - c.height - 6}px`;
    tok.setAttribute("aria-describedby", "tok-card");
  }
  function hide() { card.hidden = true; current = null; }

  const tokenOf = (el) => el?.closest?.(".tokens .tok");
  document.addEventListener("mouseover", (e) => { const t = tokenOf(e.target); if (t) show(t); });
  document.addEventListener("mouseout", (e) => { if (tokenOf(e.target) && document.activeElement !== tokenOf(e.target)) hide(); });
  document.addEventListener("focusin", (e) => {
    if (e.target.matches(".tokens") && !e.relatedTarget?.closest?.(".tokens")) {
      const first = e.target.querySelector(".tok");  // moved after this focus event settles
      if (first) { first.tabIndex = -1; setTimeout(() => first.focus()); }
    } else if (tokenOf(e.target)) show(e.target);
  });
  document.addEventListener("focusout", (e) => { if (tokenOf(e.target)) hide(); });
  document.addEventListener("keydown", (e) => {
    const tok = tokenOf(e.target);
    if (!tok) return;
    const all = [...tok.parentElement.querySelectorAll(".tok")];
    const i = all.indexOf(tok);
    const next = {ArrowRight: i + 1, ArrowDown: i + 1, ArrowLeft: i - 1, ArrowUp: i - 1, Home: 0, End: all.length - 1}[e.key];
    if (e.key === "Escape") { hide(); tok.parentElement.focus(); return; }
    if (next === undefined || !all[next]) return;
    e.preventDefault();
    all[next].tabIndex = -1;
    all[next].focus();
  });
  window.addEventListener("scroll", () => { if (current) show(current); }, {passive: true});
})();
