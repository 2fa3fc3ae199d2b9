// Live run page: one websocket per run; charts (uPlot) and the status line update as events arrive.
// Without JavaScript the page still shows the latest metrics table (refreshed by htmx or a reload).
(function () {
  const root = document.getElementById("run-live");
  if (!root) return;
  const runId = root.dataset.runId;
  const charts = {};   // metric name -> {plot, xs, ys}
  const CHARTED = ["rollout/reward", "ppo/loss", "ppo/clip_frac", "ppo/approx_kl", "ppo/entropy",
                   "ppo/behav_imp_weight", "staleness/max", "staleness/mean", "staleness/dropped",
                   "perf/tokens_per_s", "timing/step", "sessions/open"];
  let lastStep = -1;
  let retry = 500;

  function chartFor(name) {
    if (charts[name]) return charts[name];
    const box = document.createElement("div");
    box.className = "chart";
    box.dataset.metric = name;
    root.querySelector(".charts").appendChild(box);
    const data = {xs: [], ys: []};
    const plot = new uPlot({
      title: name, width: Math.min(520, box.clientWidth || 520), height: 200,
      scales: {x: {time: false}},
      series: [{label: "step"}, {label: name, stroke: "#3b5bdb", width: 2, points: {show: true, size: 4}}],
      axes: [{label: "step"}, {}],
    }, [data.xs, data.ys], box);
    charts[name] = Object.assign(data, {plot});
    return charts[name];
  }

  function addPoints(points) {
    const touched = new Set();
    for (const p of points) {
      if (!CHARTED.includes(p.name) && !p.name.startsWith("rollout/")) continue;
      const c = chartFor(p.name);
      const i = c.xs.indexOf(p.step);
      if (i >= 0) { c.ys[i] = p.value; } else { c.xs.push(p.step); c.ys.push(p.value); }
      touched.add(p.name);
      lastStep = Math.max(lastStep, p.step);
    }
    for (const name of touched) {
      const c = charts[name];
      const order = c.xs.map((x, i) => [x, c.ys[i]]).sort((a, b) => a[0] - b[0]);
      c.xs.splice(0, c.xs.length, ...order.map((o) => o[0]));
      c.ys.splice(0, c.ys.length, ...order.map((o) => o[1]));
      c.plot.setData([c.xs, c.ys]);
    }
    if (points.length) root.dataset.lastStep = String(lastStep);
  }

  function setStatus(s) {
    for (const [key, value] of Object.entries({status: s.status, step: s.step, version: s.weight_version})) {
      const el = document.querySelector(`[data-live="${key}"]`);
      if (el && value !== undefined) el.textContent = value;
    }
    const badge = document.querySelector('[data-live="status"]');
    if (badge && s.status) badge.className = `badge status-${s.status}`;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const ws = new WebSocket(`${scheme}://${location.host}/ws/runs/${runId}/?since_step=${lastStep}`);
    ws.onopen = () => { retry = 500; root.dataset.connected = "1"; };
    ws.onmessage = (message) => {
      const event = JSON.parse(message.data);
      if (event.type === "snapshot") { setStatus(event.status); addPoints(event.metrics); }
      else if (event.type === "metrics") { addPoints(event.points); setStatus({step: event.step, weight_version: event.weight_version}); }
      else if (event.type === "status") { setStatus(event); }
    };
    ws.onclose = () => { root.dataset.connected = "0"; setTimeout(connect, retry); retry = Math.min(retry * 2, 10000); };
  }
  connect();
})();
