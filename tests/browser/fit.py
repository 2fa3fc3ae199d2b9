"""Does a page fit its viewport? ``assert_fits(page)`` for any browser test at any width.

A page "fits" when nothing a person reads or clicks is out of reach: the last visible cell of
every table row (a column hidden on a phone leaves the one before it last) and every visible
form control (input, select, textarea, button) ends inside the viewport and inside every box
that clips it (a ``.table-scroll`` wrapper, a card with ``overflow: hidden``): a table
scrolled inside a narrow card hides its last column as surely as one that runs off the screen.
"""

from __future__ import annotations

# Offenders as "what: right edge > limit (where)"; elements not rendered (display: none, inside
# a closed <details>) or visibility: hidden are not seen, so not checked.
_OFFENDERS = """
() => {
  window.scrollTo(0, window.scrollY);
  const viewport = document.documentElement.clientWidth;
  const offenders = [];
  const describe = (el) => {
    const id = el.id ? "#" + el.id : "";
    const name = el.getAttribute("name") ? `[name=${el.getAttribute("name")}]` : "";
    const text = (el.innerText || el.value || "").trim().replace(/\\s+/g, " ").slice(0, 40);
    const table = el.closest("table");
    const where = el.closest("[id]");
    return `${el.tagName.toLowerCase()}${id}${name} "${text}"` +
      (table && table !== el ? ` in ${table.id ? "table#" + table.id : "a table"}` : "") +
      (where && where !== el ? ` under #${where.id}` : "");
  };
  const seen = (el) => {  // a closed <details> lays its content out, hidden (content-visibility)
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && el.checkVisibility({visibilityProperty: true});
  };
  const limit = (el) => {  // the viewport, narrowed by every ancestor that clips sideways
    let right = viewport, left = 0;
    for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
      const style = getComputedStyle(a);
      if (style.overflowX !== "visible") {
        const r = a.getBoundingClientRect();
        left = Math.max(left, r.left + a.clientLeft);
        right = Math.min(right, r.left + a.clientLeft + a.clientWidth);
      }
    }
    return [left, right];
  };
  const check = (el) => {
    if (!seen(el)) return;
    const r = el.getBoundingClientRect();
    const [left, right] = limit(el);
    if (r.right > right + 0.5 || r.left < left - 0.5) {
      offenders.push(`${describe(el)}: ${Math.round(r.left)}..${Math.round(r.right)} ` +
                     `outside ${Math.round(left)}..${Math.round(right)}`);
    }
  };
  for (const table of document.querySelectorAll("table")) {
    for (const row of table.rows) {  // the last cell a person sees: a column hidden on a phone
      const cells = [...row.cells].filter(seen);  // (display: none) leaves the one before it
      if (cells.length) check(cells[cells.length - 1]);
    }
  }
  document.querySelectorAll("input, select, textarea, button").forEach(check);
  return offenders;
}
"""


def offenders(page) -> list[str]:
    """What on ``page`` (its current viewport) ends outside the viewport or its clipping box."""
    return page.evaluate(_OFFENDERS)


def assert_fits(page) -> None:
    """Fail, naming each element, where a visible table's last column or a visible form control
    ends outside the viewport or outside a box that clips it."""
    found = offenders(page)
    width = page.viewport_size["width"] if page.viewport_size else "?"
    assert not found, f"{len(found)} element(s) do not fit at {width} px:\n" + "\n".join(found)
