// The dashboard's live refresh: poll the JSON API and redraw the charts with Plotly.react.
// The page is complete without this script (numbers and a history table rendered by the server);
// this adds the charts and keeps them current. Only new history points are fetched on each poll.
"use strict";
(function () {
  const root = document.getElementById("dashboard");
  const refreshMs = Number(root.dataset.refreshMs) || 5000;
  const MAX_POINTS = 20000;  // keep the browser responsive on long runs
  let history = JSON.parse(document.getElementById("history-data").textContent);

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "\u2014";
    let s = Math.max(0, Math.round(seconds));
    const d = Math.floor(s / 86400); s -= d * 86400;
    const h = Math.floor(s / 3600); s -= h * 3600;
    const m = Math.floor(s / 60); s -= m * 60;
    const pad = (n) => String(n).padStart(2, "0");
    if (d) return `${d} d ${h} h`;
    if (h) return `${h} h ${pad(m)} min`;
    if (m) return `${m} min ${pad(s)} s`;
    return `${s} s`;
  }

  function setStat(name, text) {
    for (const el of document.querySelectorAll(`[data-stat="${name}"]`)) el.textContent = text;
  }

  function showStatus(status) {
    setStat("epoch", status.epoch);
    setStat("total_epochs", status.total_epochs || "?");
    setStat("active_peers", status.active_peers);
    setStat("samples_per_second", status.samples_per_second.toFixed(1));
    setStat("loss", status.loss === null ? "\u2014" : status.loss.toFixed(4));
    setStat("eta", status.finished ? "finished" : duration(status.eta_s));
    const finished = document.getElementById("run-finished");  // the server renders its text
    if (finished && status.finished) finished.hidden = false;
    const progress = status.total_epochs ? Math.min(status.epoch / status.total_epochs, 1) : 0;
    for (const bar of document.querySelectorAll('[data-stat="progress"]')) bar.style.width = `${(progress * 100).toFixed(1)}%`;
    showProblems(status.problems || []);
  }

  function showProblems(problems) {
    const list = document.getElementById("problems");
    if (!list) return;
    list.replaceChildren(...problems.map((text) => {
      const item = document.createElement("li");
      item.textContent = text;  // a problem may quote a stranger's value: text, never HTML
      return item;
    }));
    list.hidden = problems.length === 0;
  }

  // Validation losses: one line per held-out split through the points taken at checkpoints
  // (the points with a valid_loss), drawn over the training loss.
  const SPLIT_COLORS = ["#c0392b", "#a4530b", "#6b3fa0", "#17803d"];
  function validationTraces() {
    const checkpoints = history.filter((p) => p.valid_loss);
    const splits = [...new Set(checkpoints.flatMap((p) => Object.keys(p.valid_loss)))]
      .sort((a, b) => (a !== "valid") - (b !== "valid") || a.localeCompare(b));
    return splits.map((split, i) => {
      const points = checkpoints.filter((p) => typeof p.valid_loss[split] === "number");
      return {x: points.map((p) => new Date(p.time * 1000)), y: points.map((p) => p.valid_loss[split]),
              name: `${split} (validation)`, type: "scatter", mode: "lines+markers",
              line: {color: SPLIT_COLORS[i % SPLIT_COLORS.length], dash: "dot"},
              hovertemplate: `${split} %{y:.4f}<extra>%{x|%H:%M:%S}</extra>`};
    });
  }

  const config = {responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"]};
  function layout(yTitle, extra) {
    return Object.assign({
      margin: {l: 55, r: 15, t: 10, b: 40}, xaxis: {type: "date"}, yaxis: {title: {text: yTitle}},
      showlegend: false, uirevision: "keep-zoom",  // a user's zoom survives the redraws
    }, extra || {});
  }
  function trace(y, color, shape) {
    return [{x: history.map((p) => new Date(p.time * 1000)), y: history.map(y), type: "scatter",
             mode: history.length > 60 ? "lines" : "lines+markers", line: {color: color, shape: shape || "linear"},
             connectgaps: false, hovertemplate: "%{y}<extra>%{x|%H:%M:%S}</extra>"}];
  }

  function draw() {
    if (typeof Plotly === "undefined") return;
    document.getElementById("charts").hidden = false;  // before drawing: plotly sizes charts from their box
    const validation = validationTraces();
    const training = Object.assign(trace((p) => p.loss, "#2456c7")[0], {name: "training"});
    Plotly.react("chart-loss", [training].concat(validation),
                 layout("loss", validation.length ? {showlegend: true, legend: {orientation: "h", x: 0, y: 1.14},
                                                     margin: {l: 55, r: 15, t: 30, b: 40}} : {}),
                 config);
    Plotly.react("chart-peers", trace((p) => p.active_peers, "#17803d", "hv"), layout("peers", {yaxis: {title: {text: "peers"}, rangemode: "tozero"}}), config);
    Plotly.react("chart-throughput", trace((p) => p.samples_per_second, "#a4530b"), layout("samples/s", {yaxis: {title: {text: "samples/s"}, rangemode: "tozero"}}), config);
    Plotly.react("chart-epoch", trace((p) => p.epoch, "#6b3fa0", "hv"), layout("epoch", {yaxis: {title: {text: "epoch"}, rangemode: "tozero"}}), config);
    const table = document.getElementById("history-table");  // the no-JavaScript stand-in
    if (table) table.hidden = true;
    const empty = document.getElementById("no-history");
    if (empty && history.length) empty.remove();
  }

  async function poll() {
    const live = document.getElementById("live-status");
    try {
      const since = history.length ? history[history.length - 1].time : 0;
      const [statusResp, historyResp] = await Promise.all([
        fetch("/api/status", {cache: "no-store"}),
        fetch(`/api/history?since=${since}`, {cache: "no-store"}),
      ]);
      // Read both answers first, then update the page in one go (charts, numbers, "Live" line).
      const fresh = historyResp.ok ? await historyResp.json() : [];
      const status = statusResp.ok ? await statusResp.json() : null;
      if (status) {
        showStatus(status);
        live.textContent = `Live: refreshed at ${new Date().toLocaleTimeString()}, every ${refreshMs / 1000} s.`;
      } else {
        live.textContent = "The run is starting; retrying\u2026";
      }
      if (fresh.length) {
        history = history.concat(fresh);
        if (history.length > MAX_POINTS) history = history.slice(history.length - MAX_POINTS);
        draw();
      }
    } catch (err) {
      live.textContent = `Coordinator unreachable (${err.message}); retrying every ${refreshMs / 1000} s\u2026`;
    } finally {
      setTimeout(poll, refreshMs);
    }
  }

  draw();
  setTimeout(poll, refreshMs);
})();
