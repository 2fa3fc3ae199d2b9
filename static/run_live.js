// The run page's charts (uPlot), progress line and latest-values table. The page embeds the
// run's metrics so far (#run-data); one websocket per run adds each new step and status change
// (a reconnect resumes after the last step seen). Smoothing and the x axis (step or time) are
// local choices, remembered in localStorage.
(function () {
  const root = document.getElementById("run-live");
  const dataEl = document.getElementById("run-data");
  if (!root || !dataEl || typeof uPlot === "undefined") return;
  const initial = JSON.parse(dataEl.textContent);
  const rules = initial.config;
  const series = {};                            // name -> {steps: [], values: []}, in step order
  const stepTimes = new Map(initial.stepTimes); // step -> unix seconds when it was first reported
  const charts = {};                            // name -> {box, plot, value}
  const view = {
    smoothing: Number(localStorage.getItem("steep.smoothing") ?? 0.6),
    x: localStorage.getItem("steep.xAxis") === "time" ? "time" : "step",
  };
  const ETA_WINDOW = 10;  // as webapp/dashboard/charts.py: median pace of the last 10 step intervals
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
  // Exponential moving average (TensorBoard's smoothing, debiased so the start is not pulled to 0).
  function ema(values, alpha) {
    if (!alpha) return values.slice();
    let acc = 0, weight = 0;
    return values.map((v) => { acc = acc * alpha + (1 - alpha) * v; weight = weight * alpha + (1 - alpha); return acc / weight; });
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

  // --- where a chart goes ------------------------------------------------------------------
  const isHeadline = (name) => name === rules.headline || name.startsWith(rules.evalPrefix);
  function panelGrid(name) {
    const rule = rules.panels.find((p) => p.prefixes.some((x) => name.startsWith(x))) || rules.other;
    let panel = root.querySelector(`.panel[data-panel="${rule.id}"]`);
    if (!panel) {
      panel = document.createElement("section");
      panel.className = "panel";
      panel.dataset.panel = rule.id;
      panel.innerHTML = '<h4></h4><div class="chart-grid"></div>';
      panel.querySelector("h4").textContent = rule.title;
      const order = rules.panels.map((p) => p.id).concat(rules.other.id);
      const next = [...root.querySelectorAll(".panel")].find((p) => order.indexOf(p.dataset.panel) > order.indexOf(rule.id));
      root.insertBefore(panel, next || document.getElementById("latest-values"));
    }
    return panel.querySelector(".chart-grid");
  }
  function chartBox(name) {
    let box = [...root.querySelectorAll(".chart")].find((b) => b.dataset.metric === name);
    if (box) return box;
    box = document.createElement("div");
    box.className = "chart";
    box.dataset.metric = name;
    if (isHeadline(name)) {
      const headline = root.querySelector(".headline");
      box.classList.add("big");
      headline.hidden = false;
      name === rules.headline ? headline.prepend(box) : headline.appendChild(box);
      headline.classList.toggle("with-eval", headline.children.length > 1);
    } else {
      panelGrid(name).appendChild(box);
    }
    document.getElementById("no-metrics")?.remove();
    return box;
  }

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

  function showValue(chart, idx) {  // the hovered point, or the latest one
    if (!chart.plot) return;
    const [xs, ys] = chart.plot.data;
    const i = idx ?? ys.length - 1;
    if (i < 0) return;
    const at = view.x === "time" ? new Date(xs[i] * 1000).toLocaleTimeString() : `step ${xs[i]}`;
    chart.value.textContent = fmtValue(ys[i]);
    chart.at.textContent = at;
  }

  function makeChart(name) {
    const box = chartBox(name);
    box.replaceChildren();
    const head = document.createElement("div");
    head.className = "chart-head";
    const slash = name.indexOf("/");
    head.innerHTML = '<span class="chart-name"><span class="muted"></span><span></span></span><span class="chart-value"><b></b> <span class="muted"></span></span>';
    head.querySelector(".chart-name .muted").textContent = slash > 0 ? name.slice(0, slash + 1) : "";
    head.querySelector(".chart-name span:last-child").textContent = name.slice(slash + 1);
    box.appendChild(head);
    const big = box.classList.contains("big");
    const colour = name.startsWith(rules.evalPrefix) ? "#009e73" : "#3b5bdb";
    const chart = {box, value: head.querySelector(".chart-value b"), at: head.querySelector(".chart-value .muted")};
    chart.plot = new uPlot({
      width: Math.max(box.clientWidth, 200), height: big ? (box.clientWidth < 500 ? 220 : 280) : 160,
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
        setCursor: [(u) => showValue(chart, u.cursor.idx)],
        setScale: [(u, key) => { if (key === "y") box.dataset.yRange = `${u.scales.y.min},${u.scales.y.max}`; }],
      },
    }, plotData(name), box);
    charts[name] = chart;
    showValue(chart);
    chart.resize = new ResizeObserver(() => {
      const width = box.clientWidth;
      if (width > 0 && width !== chart.plot.width) chart.plot.setSize({width, height: chart.plot.height});
    });
    chart.resize.observe(box);
    return chart;
  }

  function redraw(name) {
    const chart = charts[name] || makeChart(name);
    chart.plot.setData(plotData(name));
    showValue(chart);
  }
  function rebuildAll() {
    for (const [name, chart] of Object.entries(charts)) { chart.resize.disconnect(); chart.plot.destroy(); delete charts[name]; }
    for (const name of Object.keys(series).sort()) makeChart(name);
  }

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
  const live = (key) => document.querySelector(`[data-live="${key}"]`);
  function setStatus(s) {
    for (const [key, value] of Object.entries({status: s.status, step: s.step, version: s.weight_version})) {
      if (live(key) && value !== undefined) live(key).textContent = value;
    }
    if (live("status") && s.status) live("status").className = `badge status-${s.status}`;
    updateProgress();
  }
  function updateProgress() {
    const step = Number(live("step")?.textContent ?? lastStep);
    const bar = document.getElementById("run-progress");
    if (bar) bar.value = step;
    const eta = live("eta");
    if (!eta) return;
    const times = [...stepTimes].sort((a, b) => a[0] - b[0]).slice(-(ETA_WINDOW + 1));
    const paces = times.slice(1).map(([s1, t1], i) => (t1 - times[i][1]) / (s1 - times[i][0])).sort((a, b) => a - b);
    const mid = paces.length >> 1;
    const pace = paces.length % 2 ? paces[mid] : (paces[mid - 1] + paces[mid]) / 2;
    const running = live("status")?.textContent.trim() === "running";
    eta.textContent = running && initial.maxSteps && paces.length && step < initial.maxSteps ? `ETA ${duration((initial.maxSteps - step) * pace)}` : "";
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
    for (const name of Object.keys(charts)) redraw(name);
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
  for (const name of Object.keys(series).sort()) makeChart(name);
  root.dataset.lastStep = String(lastStep);

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
