// The new-run form: presets fill the fields in place (their links still work without this
// script: ?preset=<slug> renders the form pre-filled), and the mode shows the dataset field
// or the note on agents. The values come from webapp.dashboard.presets, as #run-presets.
(() => {
  const form = document.getElementById("run-form");
  const data = document.getElementById("run-presets");
  if (!form || !data) return;
  const presets = JSON.parse(data.textContent);
  const description = document.getElementById("preset-description");

  const showMode = () => {
    const mode = form.elements.mode && form.elements.mode.value;
    const dataset = form.elements.dataset && form.elements.dataset.closest(".field");
    if (dataset) dataset.hidden = mode === "online";
    form.querySelectorAll("[data-mode]").forEach((el) => {
      el.hidden = el.dataset.mode !== mode;
    });
  };

  const fill = (values) => {
    for (const [name, value] of Object.entries(values)) {
      const el = form.elements[name];
      if (!el) continue;
      if (el.type === "checkbox") {
        el.checked = value === true;
      } else {
        el.value = value;
        // A select without that option (a dataset this project lacks) falls back to empty.
        if (el.tagName === "SELECT" && el.value !== value) el.value = "";
      }
    }
    showMode();
  };

  document.querySelectorAll("a[data-preset]").forEach((link) => {
    link.addEventListener("click", (event) => {
      const values = presets[link.dataset.preset];
      if (!values) return; // let the link load the page
      event.preventDefault();
      fill(values);
      document.querySelectorAll("a[data-preset]").forEach((other) => {
        if (other === link) other.setAttribute("aria-current", "true");
        else other.removeAttribute("aria-current");
      });
      if (description) description.textContent = link.dataset.description;
      history.replaceState(null, "", link.href); // a reload keeps the preset
    });
  });
  if (form.elements.mode) form.elements.mode.addEventListener("change", showMode);
  showMode();
})();
