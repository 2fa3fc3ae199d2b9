// The run page: its charts (uPlot), progress line and latest-values table, kept live. The page
// embeds the run's metrics so far and the layout rules of webapp/dashboard/charts.py
// (#run-data); one websocket per run adds each new step and status change (a reconnect resumes
// after the last step seen).
//
// Where a metric goes: the headline (the reward, eval/ metrics), the key panels (the rules' key
// metrics, plus what a person pinned, minus what they unpinned), or the folded group of its
// name's prefix: there as a chart, or while it never changed as one line with its value. A
// metric first seen live, or one that starts to vary, is placed by the same rules. Smoothing,
// the x axis and pins are local choices kept in localStorage (pins per project).

// On a phone the run page is a summary: its secondary sections start folded (they are open in
// the HTML, so the page works without JavaScript).
(function () {
  if (!window.matchMedia("(max-width: 720px)").matches) return;
  document.querySelectorAll("details.fold[open]").forEach((d) => d.removeAttribute("open"));
})();

(function () {
  const root = document.getElementById("run-live");
  const dataEl = document.getElementById("run-data");
  if (!root || !dataEl || typeof uPlot === "undefined") return;
  const initial = JSON.parse(dataEl.textContent);
  const rules = initial.config;
  const series = {};                            // name -> {steps: [], values: []}, in step order
  const stepTimes = new Map(initial.stepTimes); // step -> unix seconds when it was first reported
  const items = {};                             // name -> {name, kind, where, el, plot?, ...}
  const headlineEl = root.querySelector(".headline");
  const keyEl = document.getElementById("key-charts");
  const rolesEl = document.getElementById("role-charts");  // a multi-agent run's: a column per role
  const groupsEl = document.getElementById("metric-groups");
  const filterEl = document.getElementById("metric-filter");
  const view = {
    smoothing: Number(localStorage.getItem("steep.smoothing") ?? 0.6),
    x: localStorage.getItem("steep.xAxis") === "time" ? "time" : "step",
  };
  let lastStep = -1;
  let retry = 500;

  // --- numbers --------------------------------------------------------------------------
  const precise = new Intl.NumberFormat(undefined, {maximumSignificantDigits: 4});
  function fmtValue(v) {
    if (v == null || Number.isNaN(v)) return "–";
    if (v !== 0 && Math.abs(v) < 1e-3) return v.toExponential(3).replace(/\.?0+e/, "e");
    return precise.format(v);
  }
  function fmtTick(v) {  // short axis labels: 12k, 1.5M, 0.002
    const a = Math.abs(v);
    if (a >= 1e9) return +(v / 1e9).toPrecision(3) + "G";
    if (a >= 1e6) return +(v / 1e6).toPrecision(3) + "M";
    if (a >= 1e4) return +(v / 1e3).toPrecision(3) + "k";
    if (a !== 0 && a < 1e-3) return v.toExponential(2).replace(/\.?0+e/, "e");
    return String(+v.toPrecision(4));
  }
  const rate = (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(1).replace(/\.0$/, ""));  // as the "rate" filter
  // Exponential moving average (TensorBoard's smoothing, debiased so the start is not pulled to 0).
  function ema(values, alpha) {
    if (!alpha) return values.slice();
    let acc = 0, weight = 0;
    return values.map((v) => { acc = acc * alpha + (1 - alpha) * v; weight = weight * alpha + (1 - alpha); return acc / weight; });
  }
  // Every value the same, to a part in a billion (as charts.is_constant).
  function isConstant(values) {
    if (!values.length) return false;
    let min = Infinity, max = -Infinity;
    for (const v of values) { if (v < min) min = v; if (v > max) max = v; }
    return max - min <= Math.abs(max) * 1e-9;
  }
  // A constant (or all-zero) series gets a small range around its value, not uPlot's 0..100.
  function yRange(u, min, max) {
    if (min == null || max == null) return [0, 1];
    if (max - min <= Math.abs(max) * 1e-9) {  // constant, give or take the smoothing's rounding
      const pad = max === 0 ? 0.5 : Math.abs(max) * 0.1;
      return [max - pad, max + pad];
    }
    const pad = (max - min) * 0.08;
    return [min >= 0 && min - pad < 0 ? 0 : min - pad, max + pad];
  }
  // The y axis is as wide as its longest label (uPlot's fixed width clips "12,345").
  function axisSize(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    if (cycleNum > 1) return axis._size;
    const longest = (values || []).reduce((a, v) => (v.length > a.length ? v : a), "");
    u.ctx.font = axis.font[0];
    return Math.ceil(axis.ticks.size + axis.gap + u.ctx.measureText(longest).width / devicePixelRatio) + 4;
  }

  // --- pins ---------------------------------------------------------------------------------
  const pinsKey = `steep.pins.${root.dataset.projectId}`;
  const pins = (() => {
    try {
      const saved = JSON.parse(localStorage.getItem(pinsKey) || "{}");
      return {pinned: saved.pinned || [], unpinned: saved.unpinned || []};
    } catch { return {pinned: [], unpinned: []}; }
  })();
  const isHeadline = (name) => name === rules.headline || name.startsWith(rules.evalPrefix);
  function roleOf(name) {  // as charts.role_of: "speaker" for roles/speaker/reward
    if (!rules.rolesPrefix || !name.startsWith(rules.rolesPrefix)) return null;
    const rest = name.slice(rules.rolesPrefix.length), slash = rest.indexOf("/");
    return slash > 0 && slash < rest.length - 1 ? rest.slice(0, slash) : null;
  }
  const isKey = (name) => pins.pinned.includes(name) || (rules.key.includes(name) && !pins.unpinned.includes(name));
  function togglePin(name) {
    const pin = !isKey(name);
    pins.pinned = pins.pinned.filter((n) => n !== name);
    pins.unpinned = pins.unpinned.filter((n) => n !== name);
    if (pin && !rules.key.includes(name)) pins.pinned.push(name);
    if (!pin && rules.key.includes(name)) pins.unpinned.push(name);
    localStorage.setItem(pinsKey, JSON.stringify(pins));
    place(name);
    settle();
    items[name]?.el.querySelector(".pin")?.focus();
  }
  const PIN_ICON = '<svg viewBox="0 0 16 16" aria-hidden="true"><path d="M9.8 1.6 14.4 6.2 13.1 6.9 10.6 9.4 10.8 12.4 9.6 13.6 6.7 10.7 2.6 14.8 1.2 14.8 1.2 13.4 5.3 9.3 2.4 6.4 3.6 5.2 6.6 5.4 9.1 2.9Z"/></svg>';
  function pinButton(name) {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "pin";
    button.innerHTML = PIN_ICON;
    button.addEventListener("click", () => togglePin(name));
    return button;
  }
  function showPin(item) {
    const button = item.el.querySelector(".pin");
    if (!button) return;
    const pinned = item.where === "key";
    button.setAttribute("aria-pressed", String(pinned));
    button.title = pinned ? "Unpin: back to its group" : "Pin to the key panels";
    button.setAttribute("aria-label", `${pinned ? "Unpin" : "Pin"} ${item.name}`);
  }

  // --- where a metric goes ------------------------------------------------------------------
  function groupOf(name) {  // as charts.group_of: the name's prefix
    const slash = name.indexOf("/");
    return slash < 0 ? rules.other : {id: name.slice(0, slash), title: groupTitle(name.slice(0, slash))};
  }
  function groupTitle(id) {
    if (id === rules.other.id) return rules.other.title;
    const plain = id.replace(/_/g, " ");
    return rules.groups.find((g) => g.id === id)?.title ?? plain.charAt(0).toUpperCase() + plain.slice(1).toLowerCase();
  }
  function groupRank(id) {
    const known = rules.groups.findIndex((g) => g.id === id);
    if (known >= 0) return [0, known];
    return id === rules.other.id ? [2, ""] : [1, id];
  }
  function target(name) {
    if (rules.notPlotted.includes(name)) return null;
    if (isHeadline(name)) return {kind: "chart", where: "headline"};
    if (roleOf(name) && rolesEl) return {kind: "chart", where: "role:" + roleOf(name)};
    if (isKey(name)) return {kind: "chart", where: "key"};
    return {kind: isConstant(series[name]?.values ?? []) ? "constant" : "chart", where: groupOf(name).id};
  }
  function rank(name, where) {  // an element's place among its siblings
    if (where === "headline") return [name === rules.headline ? 0 : 1, name];
    if (where.startsWith("role:")) return [name === `${rules.rolesPrefix}${where.slice(5)}/${rules.roleFirst}` ? 0 : 1, name];
    if (where === "key") {
      const i = rules.key.indexOf(name);
      return i >= 0 ? [0, i] : [1, pins.pinned.indexOf(name)];
    }
    return [0, name];
  }
  const before = (a, b) => a[0] < b[0] || (a[0] === b[0] && a[1] < b[1]);
  function insertSorted(parent, el, key, keyOf) {
    const next = [...parent.children].find((c) => c !== el && before(key, keyOf(c)));
    parent.insertBefore(el, next || null);
  }
  function groupEl(id) {
    let group = [...groupsEl.children].find((d) => d.dataset.group === id);
    if (group) return group;
    group = document.createElement("details");
    group.className = "metric-group";
    group.dataset.group = id;
    group.innerHTML = '<summary><span class="group-title"></span> <span class="group-count"></span></summary><div class="chart-grid"></div><ul class="constants"></ul>';
    group.querySelector(".group-title").textContent = groupTitle(id);
    insertSorted(groupsEl, group, groupRank(id), (d) => groupRank(d.dataset.group));
    return group;
  }
  function roleColumn(role) {  // a role first seen live gets its column after the others
    const columns = rolesEl.querySelector(".role-columns");
    let column = [...columns.children].find((c) => c.dataset.role === role);
    if (column) return column;
    column = document.createElement("div");
    column.className = "role-column";
    column.dataset.role = role;
    column.innerHTML = '<h4><span class="badge role-badge"></span></h4><div class="chart-grid"></div>';
    column.querySelector(".role-badge").textContent = role;
    columns.appendChild(column);
    return column;
  }
  function container(where, kind) {
    if (where === "headline") return headlineEl;
    if (where === "key") return keyEl;
    if (where.startsWith("role:")) return roleColumn(where.slice(5)).querySelector(".chart-grid");
    return groupEl(where).querySelector(kind === "chart" ? ".chart-grid" : ".constants");
  }

  function chartHead(item) {
    const head = document.createElement("div");
    head.className = "chart-head";
    const slash = item.name.indexOf("/");
    head.innerHTML = '<span class="chart-name"><span class="muted"></span><span></span></span><span class="chart-value"><b></b> <span class="muted"></span></span>';
    head.querySelector(".chart-name .muted").textContent = slash > 0 ? item.name.slice(0, slash + 1) : "";
    head.querySelector(".chart-name span:last-child").textContent = item.name.slice(slash + 1);
    head.querySelector(".chart-name").title = item.name;
    if (!isHeadline(item.name) && !roleOf(item.name)) head.appendChild(pinButton(item.name));
    item.el.replaceChildren(head);
    item.value = head.querySelector(".chart-value b");
    item.at = head.querySelector(".chart-value .muted");
  }
  function constantLine(item) {
    item.el.innerHTML = '<span class="constant-name"></span><span class="constant-text">: <b class="constant-value"></b> <span class="muted">(constant)</span></span>';
    Object.assign(item.el.querySelector(".constant-name"), {textContent: item.name, title: item.name});
    item.el.appendChild(pinButton(item.name));
    item.value = item.el.querySelector(".constant-value");
  }
  function adopt(el) {  // a box or line the server rendered
    const name = el.dataset.metric;
    const kind = el.classList.contains("constant") ? "constant" : "chart";
    const column = el.closest(".role-column");
    const where = el.parentElement === headlineEl ? "headline" : el.parentElement === keyEl ? "key" : column ? "role:" + column.dataset.role : el.closest(".metric-group").dataset.group;
    const item = items[name] = {name, kind, where, el};
    kind === "chart" ? chartHead(item) : constantLine(item);
  }
  function create(name, kind) {
    const el = document.createElement(kind === "chart" ? "div" : "li");
    el.className = kind;
    el.dataset.metric = name;
    const item = {name, kind, where: null, el};
    kind === "chart" ? chartHead(item) : constantLine(item);
    return item;
  }
  function drop(item) {
    if (item.plot) { item.resize.disconnect(); item.plot.destroy(); }
    item.el.remove();
    delete items[item.name];
  }
  // Put ``name`` where the rules say (a no-op when it is there already).
  function place(name) {
    const want = target(name);
    let item = items[name];
    if (item && (!want || item.kind !== want.kind)) { drop(item); item = null; }
    if (!want) return;
    if (!item) item = items[name] = create(name, want.kind);
    if (item.where !== want.where || !item.el.isConnected) {
      item.where = want.where;
      item.el.classList.toggle("big", want.where === "headline");
      insertSorted(container(want.where, want.kind), item.el, rank(name, want.where), (c) => rank(c.dataset.metric, want.where));
    }
    showPin(item);
  }
  // After placing: counts, empty areas hidden, the filter applied, visible charts drawn.
  function settle() {
    for (const group of groupsEl.children) {
      const charts = group.querySelectorAll(".chart").length, constants = group.querySelectorAll(".constant").length;
      group.querySelector(".group-count").textContent = [
        charts ? `${charts} chart${charts === 1 ? "" : "s"}` : "",
        constants ? `${constants} constant` : "",
      ].filter(Boolean).join(" · ");
      group.dataset.size = String(charts + constants);
    }
    headlineEl.classList.toggle("with-eval", headlineEl.children.length > 1);
    if (Object.keys(items).length) document.getElementById("no-metrics")?.remove();
    applyFilter();
  }

  // --- the filter -----------------------------------------------------------------------------
  // Space-separated words, each somewhere in the name. While it filters, the groups with a match
  // open; cleared, they fold back as they were.
  function applyFilter() {
    const words = filterEl.value.trim().toLowerCase().split(/\s+/).filter(Boolean);
    let shown = 0;
    for (const item of Object.values(items)) {
      const hit = words.every((w) => item.name.toLowerCase().includes(w));
      item.el.hidden = !hit;
      shown += hit;
    }
    headlineEl.hidden = !headlineEl.querySelector(":scope > :not([hidden])");
    keyEl.hidden = !keyEl.querySelector(":scope > :not([hidden])");
    if (rolesEl) rolesEl.hidden = !rolesEl.querySelector(".chart:not([hidden])");
    for (const group of groupsEl.children) {
      const hits = group.querySelectorAll("[data-metric]:not([hidden])").length;
      group.hidden = hits === 0;
      if (words.length) {
        if (!("wasOpen" in group.dataset)) group.dataset.wasOpen = group.open ? "1" : "";
        group.open = hits > 0;
      } else if ("wasOpen" in group.dataset) {
        group.open = group.dataset.wasOpen === "1";
        delete group.dataset.wasOpen;
      }
    }
    document.getElementById("filter-empty").hidden = !words.length || shown > 0;
    drawVisible();
  }
  filterEl.addEventListener("input", applyFilter);
  filterEl.addEventListener("keydown", (e) => { if (e.key === "Escape") { filterEl.value = ""; applyFilter(); } });

  // --- charts -------------------------------------------------------------------------------
  function plotData(name) {
    const s = series[name];
    let xs = s.steps, ys = s.values;
    if (view.x === "time") {
      const pairs = s.steps.map((st, i) => [stepTimes.get(st), s.values[i]]).filter((p) => p[0] != null).sort((a, b) => a[0] - b[0]);
      xs = pairs.map((p) => p[0]);
      ys = pairs.map((p) => p[1]);
    }
    // An eval point is already an average over the eval set, and they are sparse: not smoothed.
    return [xs, ys, ema(ys, name.startsWith(rules.evalPrefix) ? 0 : view.smoothing)];
  }
  function showValue(item, idx) {  // the hovered point, or the latest one
    if (item.kind === "constant") { item.value.textContent = fmtValue(series[item.name].values.at(-1)); return; }
    if (!item.plot) return;
    const [xs, ys] = item.plot.data;
    const i = idx ?? ys.length - 1;
    if (i < 0) return;
    item.value.textContent = fmtValue(ys[i]);
    item.at.textContent = view.x === "time" ? new Date(xs[i] * 1000).toLocaleTimeString() : `step ${xs[i]}`;
  }
  // Charts are drawn once they can be seen: a folded group's wait until it opens.
  const visible = (el) => !el.hidden && !el.closest("details:not([open]), [hidden]");
  function makePlot(item) {
    const {name, el: box} = item;
    const big = item.where === "headline";
    const colour = name.startsWith(rules.evalPrefix) ? "#009e73" : "#3b5bdb";
    item.plot = new uPlot({
      width: Math.max(box.clientWidth, 200), height: big ? (box.clientWidth < 500 ? 200 : 280) : 160,
      legend: {show: false},
      cursor: {sync: {key: "run"}, drag: {x: true, y: false}},
      scales: {x: {time: view.x === "time"}, y: {range: yRange}},
      series: [
        {label: view.x},
        {label: name, stroke: colour + "55", width: 1, points: {show: false}},
        {label: "smoothed", stroke: colour, width: 2},
      ],
      axes: [
        {size: view.x === "time" ? 44 : 30, space: 60},
        {size: axisSize, values: (u, splits) => splits.map(fmtTick)},
      ],
      hooks: {
        setCursor: [(u) => showValue(item, u.cursor.idx)],
        setScale: [(u, key) => { if (key === "y") box.dataset.yRange = `${u.scales.y.min},${u.scales.y.max}`; }],
      },
    }, plotData(name), box);
    item.resize = new ResizeObserver(() => {
      const width = box.clientWidth;
      if (width > 0 && width !== item.plot.width) item.plot.setSize({width, height: item.plot.height});
    });
    item.resize.observe(box);
    showValue(item);
  }
  function drawVisible() {
    for (const item of Object.values(items)) {
      if (item.kind === "chart" && !item.plot && visible(item.el)) makePlot(item);
    }
  }
  function redraw(name) {
    const item = items[name];
    if (!item) return;
    if (item.plot) item.plot.setData(plotData(name));
    else if (item.kind === "chart" && visible(item.el)) makePlot(item);
    showValue(item);
  }
  function rebuildAll() {
    for (const item of Object.values(items)) {
      if (item.plot) { item.resize.disconnect(); item.plot.destroy(); item.plot = null; }
    }
    drawVisible();
  }
  groupsEl.addEventListener("toggle", () => drawVisible(), true);  // (toggle does not bubble)

  // --- data in ----------------------------------------------------------------------------------
  function insert(name, step, value) {
    const s = (series[name] ??= {steps: [], values: []});
    let i = s.steps.length;
    while (i > 0 && s.steps[i - 1] > step) i--;
    if (s.steps[i - 1] === step) s.values[i - 1] = value;
    else { s.steps.splice(i, 0, step); s.values.splice(i, 0, value); }
    lastStep = Math.max(lastStep, step);
  }

  function addPoints(points) {
    const touched = new Set();
    for (const p of points) {
      insert(p.name, p.step, p.value);
      if (p.t != null && !stepTimes.has(p.step)) stepTimes.set(p.step, p.t);
      touched.add(p.name);
      updateRow(p);
    }
    for (const name of touched) place(name);  // new metrics, and constants that start to vary
    if (touched.size) settle();
    for (const name of touched) redraw(name);
    if (points.length) { root.dataset.lastStep = String(lastStep); updateProgress(); }
  }

  function updateRow(p) {
    const body = document.querySelector("#metrics-table tbody");
    let row = [...body.rows].find((r) => r.dataset.metric === p.name);
    if (!row) {
      row = body.insertRow();
      row.dataset.metric = p.name;
      row.insertCell().textContent = p.name;
      row.insertCell(); row.insertCell();
      const count = document.querySelector('[data-live="metric-count"]');
      if (count) count.textContent = body.rows.length;
    }
    if (Number(row.cells[1].textContent || -1) > p.step) return;
    row.cells[1].textContent = p.step;
    row.cells[2].textContent = p.value.toFixed(4);
  }

  // --- status and progress ----------------------------------------------------------------
  // As charts.progress: the median pace of the last etaWindow step intervals gives a dataset
  // run's ETA; an online run (or one whose end is out of reach) shows that pace instead.
  const live = (key) => document.querySelector(`[data-live="${key}"]`);
  function setStatus(s) {
    for (const [key, value] of Object.entries({status: s.status, step: s.step, version: s.weight_version})) {
      if (live(key) && value !== undefined) live(key).textContent = value;
    }
    if (live("status") && s.status) live("status").className = `badge status-${s.status}`;
    updateProgress();
  }
  function median(xs) {
    const sorted = [...xs].sort((a, b) => a - b), mid = sorted.length >> 1;
    return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
  }
  function updateProgress() {
    const step = Number(live("step")?.textContent ?? lastStep);
    const bar = document.getElementById("run-progress");
    if (bar) bar.value = step;
    const times = [...stepTimes].sort((a, b) => a[0] - b[0]).slice(-(rules.etaWindow + 1));
    const paces = times.slice(1).map(([s1, t1], i) => (t1 - times[i][1]) / (s1 - times[i][0])).filter((p) => p > 0);
    const stepSeconds = paces.length ? median(paces) : null;
    const running = live("status")?.textContent.trim() === "running";
    const end = initial.maxSteps && initial.maxSteps < rules.unboundedSteps ? initial.maxSteps : null;
    let eta = running && stepSeconds && end && step < end ? (end - step) * stepSeconds : null;
    const pace = running && stepSeconds && (initial.mode === "online" || !end || eta > rules.etaHorizon);
    if (pace) eta = null;
    if (live("eta")) live("eta").textContent = eta != null ? `ETA ${duration(eta)}` : "";
    if (live("pace")) live("pace").textContent = pace ? paceText(60 / stepSeconds) : "";
  }
  function paceText(perMin) {
    const n = series["rollout/num_trajectories"]?.values.slice(-(rules.etaWindow + 1)) ?? [];
    const perStep = n.length ? n.reduce((a, b) => a + b, 0) / n.length : null;
    return `${rate(perMin)} steps/min` + (perStep != null ? ` · ${rate(perMin * perStep)} trajectories/min` : "");
  }
  function duration(seconds) {  // as the "duration" template filter
    const s = Math.round(seconds);
    if (s < 60) return `${s} s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} min ${String(s % 60).padStart(2, "0")} s`;
    return `${Math.floor(m / 60)} h ${String(m % 60).padStart(2, "0")} min`;
  }

  // --- controls -----------------------------------------------------------------------------
  const slider = document.getElementById("smoothing");
  const sliderOut = document.getElementById("smoothing-value");
  slider.value = view.smoothing;
  sliderOut.textContent = view.smoothing.toFixed(2);
  slider.addEventListener("input", () => {
    view.smoothing = Number(slider.value);
    sliderOut.textContent = view.smoothing.toFixed(2);
    localStorage.setItem("steep.smoothing", slider.value);
    for (const item of Object.values(items)) if (item.plot) redraw(item.name);
  });
  const axisButtons = root.querySelectorAll("[data-x-axis]");
  function setAxis(x) {
    view.x = x;
    localStorage.setItem("steep.xAxis", x);
    axisButtons.forEach((b) => b.setAttribute("aria-pressed", String(b.dataset.xAxis === x)));
  }
  axisButtons.forEach((b) => b.addEventListener("click", () => { if (b.dataset.xAxis !== view.x) { setAxis(b.dataset.xAxis); rebuildAll(); } }));
  setAxis(view.x);

  // --- start ------------------------------------------------------------------------------------
  for (const [name, [steps, values]] of Object.entries(initial.series)) {
    steps.forEach((step, i) => insert(name, step, values[i]));
  }
  root.querySelectorAll(".chart[data-metric], .constant[data-metric]").forEach(adopt);
  for (const name of Object.keys(series).sort()) place(name);  // pins move to the key panels
  settle();
  for (const item of Object.values(items)) showValue(item);
  root.dataset.lastStep = String(lastStep);
  root.dataset.ready = "1";

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}/ws/runs/${root.dataset.runId}/?since_step=${lastStep}`);
    ws.onopen = () => { retry = 500; root.dataset.connected = "1"; };
    ws.onmessage = (message) => {
      const event = JSON.parse(message.data);
      if (event.type === "snapshot") { addPoints(event.metrics); setStatus(event.status); }
      else if (event.type === "metrics") { addPoints(event.points); setStatus({step: event.step, weight_version: event.weight_version}); }
      else if (event.type === "status") { setStatus(event); }
    };
    ws.onclose = () => { root.dataset.connected = "0"; setTimeout(connect, retry); retry = Math.min(retry * 2, 10000); };
  }
  connect();
})();
