// The smolforge dashboard: the overview (nodes, jobs) and a page per job (#job=<id>): state, ETA,
// curves drawn with the vendored uPlot, tasks, events, pause/resume/cancel; one log view: on the overview
// every job's task lines filtered by node, level, job and text, on a job page that job's (GET /api/v1/logs,
// what `smolforge logs` reads).
// The token comes from the URL fragment (#token=…, never sent to the server) or the login box and is
// kept in sessionStorage; every API call carries it as a bearer token. All text from the API goes in
// with textContent (node, model and job names are user input).
"use strict";
(function () {
  var KEY = "smolforge-token";
  var REFRESH_MS = 2000;
  var METRICS_EVERY_MS = 4000;   // a running job's curves: a little slower than the tables
  var MAX_EVENTS = 400;
  var MAX_LOG_LINES = 500;       // the log view keeps the newest this many
  var LOG_PAGE = 200;
  var COLORS = ["#2f81f7", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#0a7ea4", "#bc4c00", "#6e7781"];
  var TITLES = { loss: "loss (train and eval)", lr: "learning rate", tokens_per_s: "tokens/s",
                 comm_bytes_sent: "bytes sent", comm_wait_s: "seconds waiting in collectives", grad_norm: "gradient norm" };
  var ORDER = ["loss", "lr", "tokens_per_s", "comm_bytes_sent", "grad_norm"];

  function fromHash(name) {
    var m = new RegExp("(?:^|[#&])" + name + "=([^&]+)").exec(window.location.hash || "");
    return m ? decodeURIComponent(m[1]) : null;
  }
  var token = null;
  // A `#token=` in the address (the first load, or any in-page navigation to such an address) is taken
  // into sessionStorage and removed from the address bar at once, keeping the page it names.
  function takeToken() {
    var found = fromHash("token");
    if (!found) return false;
    token = found;
    try { sessionStorage.setItem(KEY, found); } catch (e) {}
    var job0 = fromHash("job");
    history.replaceState(null, "", window.location.pathname + (job0 ? "#job=" + encodeURIComponent(job0) : ""));
    return true;
  }
  if (!takeToken()) {
    try { token = sessionStorage.getItem(KEY); } catch (e) { token = null; }
  }

  function $(id) { return document.getElementById(id); }
  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function fmtEta(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    s = Math.max(0, Math.round(s));
    var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    return (h ? h + ":" : "") + (h && m < 10 ? "0" : "") + m + ":" + (r < 10 ? "0" : "") + r;
  }
  function fmtNum(v, digits) { return v === null || v === undefined ? "–" : Number(v).toFixed(digits); }
  function showLogin(msg) {
    $("login").style.display = "block";
    $("error").textContent = msg || "";
  }
  $("login").addEventListener("submit", function (ev) {
    ev.preventDefault();
    token = $("token-input").value.trim();
    try { sessionStorage.setItem(KEY, token); } catch (e) {}
    $("login").style.display = "none";
    refresh();
  });

  // -- the API ---------------------------------------------------------------------------------
  function api(method, path) {
    return fetch(path, { method: method, headers: { "Authorization": "Bearer " + token }, cache: "no-store" })
      .then(function (r) {
        if (r.status === 401) {
          token = null;
          try { sessionStorage.removeItem(KEY); } catch (e) {}
          throw new Error("the token was refused");
        }
        return r.json().catch(function () { return {}; }).then(function (body) {
          if (!r.ok) throw new Error((body && body.error ? body.error + (body.fix ? " (" + body.fix + ")" : "") : "API answered " + r.status));
          return body;
        });
      });
  }
  function jobPath(id, rest) { return "/api/v1/jobs/" + encodeURIComponent(id) + (rest || ""); }

  // -- overview --------------------------------------------------------------------------------
  function fmtGpus(u) {
    return (u && u.gpus && u.gpus.length) ? u.gpus.map(function (g) {
      return "GPU" + g.index + " " + Math.round(g.util_percent) + "% · " + Number(g.mem_used_gb).toFixed(1) + "/" +
        Number(g.mem_total_gb).toFixed(0) + " GB";
    }).join("; ") : "–";
  }
  function renderNodes(nodes) {
    var body = document.querySelector("#nodes tbody");
    body.textContent = "";
    var online = 0;
    nodes.forEach(function (n) {
      if (n.state === "online") online++;
      var tr = el("tr");
      tr.setAttribute("data-node", n.name);
      tr.appendChild(el("td", n.name));
      tr.appendChild(el("td", n.role));
      tr.appendChild(el("td", n.state, "state " + n.state));
      tr.appendChild(el("td", n.cpus));
      tr.appendChild(el("td", (n.ram_gb || 0).toFixed(1) + " GB"));
      tr.appendChild(el("td", n.gpus ? n.gpus + (n.gpu_type ? " × " + n.gpu_type : "") : "0"));
      var u = n.usage || {};
      tr.appendChild(el("td", u.cpu_percent !== undefined && u.cpu_percent !== null
        ? "CPU " + Math.round(u.cpu_percent) + "% · RAM " + Math.round(u.ram_percent) + "%" : "–", "usage"));
      tr.appendChild(el("td", fmtGpus(u), "gpu-usage"));
      tr.appendChild(el("td", (n.models || []).join(", ") || "–"));
      body.appendChild(tr);
    });
    $("node-count").textContent = online + " online / " + nodes.length;
    fillChoices("log-node", nodes.map(function (n) { return n.name; }));
  }
  function fmtComm(c) {
    // bytes each rank handed to collectives, and the time it waited in them (data-parallel jobs)
    if (!c || !c.bytes_sent_per_rank) return "–";
    return c.bytes_sent_per_rank.map(function (b, i) {
      var w = (c.wait_s_per_rank || [])[i];
      return (b === null ? "–" : (b / 1e6).toFixed(1) + " MB") + (w === undefined || w === null ? "" : " / " + Number(w).toFixed(1) + " s");
    }).join(" · ") + (c.rounds !== null && c.rounds !== undefined ? " · " + c.rounds + " rounds" : "");
  }
  function stateCell(j) {
    var td = el("td", j.state, "state " + j.state);
    if (j.pending_reason) td.appendChild(el("span", j.pending_reason, "reason"));
    return td;
  }
  function progressCell(j) {
    var td = el("td");
    var bar = el("span", null, "bar");
    var fill = el("span");
    var pct = Math.round(100 * (j.progress || 0));
    fill.style.width = pct + "%";
    bar.appendChild(fill);
    td.appendChild(bar);
    td.appendChild(el("span", " " + pct + "% (step " + (j.step || 0) + "/" + (j.max_steps || "?") + ")"));
    return td;
  }
  function renderJobs(jobs) {
    var body = document.querySelector("#jobs tbody");
    body.textContent = "";
    jobs.forEach(function (j) {
      var tr = el("tr");
      tr.setAttribute("data-job", j.id);
      var name = el("td");
      var a = el("a", j.name && j.name !== j.id ? j.id + " (" + j.name + ")" : j.id);
      a.href = "#job=" + encodeURIComponent(j.id);
      name.appendChild(a);
      tr.appendChild(name);
      tr.appendChild(el("td", j.kind));
      tr.appendChild(stateCell(j));
      tr.appendChild(progressCell(j));
      tr.appendChild(el("td", (j.samples_done || 0) + "/" + (j.samples_total || "?")));
      tr.appendChild(el("td", fmtNum(j.loss, 4)));
      tr.appendChild(el("td", j.state === "running" ? fmtEta(j.eta_s) : "–"));
      tr.appendChild(el("td", (j.nodes || []).join(", ") || "–"));
      tr.appendChild(el("td", fmtComm(j.comm), "comm"));
      body.appendChild(tr);
    });
    $("job-count").textContent = jobs.length ? "(" + jobs.length + ")" : "(none yet)";
    fillChoices("log-job", jobs.map(function (j) { return j.id; }));
  }
  function renderCoordinator(c) {
    $("coordinator").textContent = "coordinator " + (c.name || "") + " · " + (c.api || "") + " · Ray " +
      (c.ray_address || "") + " · up " + fmtEta(c.uptime_s);
  }
  function refreshOverview() {
    return api("GET", "/api/v1/status").then(function (s) {
      renderCoordinator(s.coordinator || {});
      renderNodes(s.nodes || []);
      var seen = {}, jobs = [];
      (s.jobs || []).concat(s.recent_jobs || []).forEach(function (j) { if (!seen[j.id]) { seen[j.id] = 1; jobs.push(j); } });
      renderJobs(jobs);
      return refreshLogs();
    });
  }

  // -- logs: every job's task lines, filtered (on a job page: that job's) ------------------------
  // The filters make the query; while it stays the same, each refresh asks only for the lines after
  // the last one shown (`after`), so a line is shown once. A changed filter starts again from the newest.
  var logView = { key: null, after: null };
  function fillChoices(id, values) {
    var sel = $(id), keep = sel.value, have = [];
    for (var i = 1; i < sel.options.length; i++) have.push(sel.options[i].value);
    if (have.join("\n") === values.join("\n")) return;
    while (sel.options.length > 1) sel.remove(1);
    values.forEach(function (v) { var o = el("option", v); o.value = v; sel.appendChild(o); });
    sel.value = values.indexOf(keep) >= 0 ? keep : "";
  }
  function logQuery() {
    var parts = [];
    [["node", "log-node"], ["level", "log-level"], ["job", "log-job"], ["grep", "log-text"]].forEach(function (f) {
      var v = f[0] === "job" && view.job ? view.job : $(f[1]).value;  // a job page: its own job's lines
      if (v) parts.push(f[0] + "=" + encodeURIComponent(v));
    });
    return parts.join("&");
  }
  function appendLogs(rows) {
    var list = $("logs");
    rows.forEach(function (r) {
      var t = new Date(r.ts * 1000);
      var li = el("li", t.toLocaleString() + " [" + r.job_id + " " + r.task + " " + (r.node || "?") + " " + r.level + "] " +
        r.line, r.level);
      li.setAttribute("data-node", r.node || "");
      li.setAttribute("data-job", r.job_id);
      li.setAttribute("data-level", r.level);
      list.appendChild(li);
    });
    while (list.childNodes.length > MAX_LOG_LINES) list.removeChild(list.firstChild);
    if (rows.length) list.scrollTop = list.scrollHeight;
    $("log-count").textContent = "(" + list.childNodes.length + (list.childNodes.length >= MAX_LOG_LINES ? ", the newest" : "") + ")";
  }
  function refreshLogs() {
    var key = logQuery();
    if (key !== logView.key) {
      logView = { key: key, after: null };
      $("logs").textContent = "";
    }
    var q = (key ? key + "&" : "") + (logView.after === null ? "" : "after=" + logView.after + "&") + "limit=" + LOG_PAGE;
    return api("GET", "/api/v1/logs?" + q).then(function (rows) {
      if (logView.key !== key) return;
      appendLogs(rows);
      // none yet: every later match is new, from the first line on
      logView.after = rows.length ? rows[rows.length - 1].id : (logView.after === null ? 0 : logView.after);
      document.body.setAttribute("data-logs", key);
    });
  }
  ["log-node", "log-level", "log-job"].forEach(function (id) { $(id).addEventListener("change", function () { refresh(); }); });
  $("log-text").addEventListener("input", function () { refresh(); });
  $("log-filters").addEventListener("submit", function (ev) { ev.preventDefault(); refresh(); });

  // -- curves ----------------------------------------------------------------------------------
  // Metric names: plain for the job (`loss`, `lr`), `<base>.rank<R>` per rank, `<base>.student<N>`
  // per student. One chart per base name (`eval_X` joins `X`), one line per full name.
  var charts = {};          // chart key -> uPlot instance (read by the browser test)
  window.smolforgeCharts = charts;
  function chartKey(name) {
    var base = name.replace(/\.(rank|student)\d+$/, "");
    return base.replace(/^eval_/, "");
  }
  function groupMetrics(rows) {
    var groups = {};
    rows.forEach(function (r) {
      if (r.value === null || r.value === undefined) return;
      var k = chartKey(r.name);
      var g = groups[k] || (groups[k] = {});
      (g[r.name] || (g[r.name] = {}))[r.step] = r.value;
    });
    return groups;
  }
  function seriesOrder(a, b) {  // the job's own line first, then per rank/student, evaluation last
    var ka = (/^eval_/.test(a) ? 2 : /\.(rank|student)\d+$/.test(a) ? 1 : 0);
    var kb = (/^eval_/.test(b) ? 2 : /\.(rank|student)\d+$/.test(b) ? 1 : 0);
    return ka - kb || a.localeCompare(b, undefined, { numeric: true });
  }
  function decimals(incr) { return Math.min(8, Math.max(0, -Math.floor(Math.log10(incr) + 1e-9))); }
  function fmtAxis(v, incr) {
    // as many digits as the tick spacing needs: a learning rate that moves from 2.0000e-4 to 1.9990e-4
    // over a long run must not read "2.00e-4" on every tick; bytes sent (1e8) read as "15M"
    if (v === null || v === undefined) return "";
    var a = Math.abs(v);
    if (a === 0) return "0";
    incr = incr > 0 ? incr : a;
    var units = [[1e9, "G"], [1e6, "M"], [1e4, "k"]];
    for (var k = 0; k < units.length; k++) {
      if (a >= units[k][0]) {
        var div = units[k][0] === 1e4 ? 1e3 : units[k][0];
        return (v / div).toFixed(decimals(incr / div)) + units[k][1];
      }
    }
    if (a < 0.01) return v.toExponential(Math.min(6, Math.max(1, Math.ceil(Math.log10(a / incr)))));
    return v.toFixed(decimals(incr));
  }
  function chartData(series) {
    var names = Object.keys(series).sort(seriesOrder);
    var steps = {};
    names.forEach(function (n) { Object.keys(series[n]).forEach(function (s) { steps[s] = 1; }); });
    var xs = Object.keys(steps).map(Number).sort(function (a, b) { return a - b; });
    var data = [xs];
    names.forEach(function (n) {
      data.push(xs.map(function (x) { var v = series[n][x]; return v === undefined ? null : v; }));
    });
    return { names: names, data: data };
  }
  function chartOrder(a, b) {
    var ia = ORDER.indexOf(a), ib = ORDER.indexOf(b);
    if (ia < 0) ia = ORDER.length;
    if (ib < 0) ib = ORDER.length;
    return ia - ib || (a < b ? -1 : a > b ? 1 : 0);
  }
  function makeChart(key, names, data, box) {
    var width = Math.max(300, (box.clientWidth || 480) - 10);
    var opts = {
      title: TITLES[key] || key, width: width, height: 220,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { size: 75, values: function (u, vals, axis, space, incr) {
        return vals.map(function (v) { return fmtAxis(v, incr); });
      } }],
      series: [{ label: "step" }].concat(names.map(function (n, i) {
        return { label: n, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
                 points: { show: data[0].length < 40 } };
      })),
    };
    var u = new uPlot(opts, data, box);
    u.seriesNames = names;
    return u;
  }
  function renderCharts(rows) {
    var groups = groupMetrics(rows);
    var keys = Object.keys(groups).sort(chartOrder);
    var holder = $("charts");
    $("no-metrics").hidden = keys.length > 0;
    Object.keys(charts).forEach(function (k) {
      if (keys.indexOf(k) < 0) { charts[k].destroy(); charts[k].root.parentNode.remove(); delete charts[k]; }
    });
    keys.forEach(function (k) {
      var cd = chartData(groups[k]);
      var u = charts[k];
      if (u && u.seriesNames.join("\n") === cd.names.join("\n")) {
        u.setData(cd.data);
        return;
      }
      var box;
      if (u) { box = u.root.parentNode; u.destroy(); box.textContent = ""; }
      else { box = el("div", null, "chart"); box.setAttribute("data-chart", k); holder.appendChild(box); }
      charts[k] = makeChart(k, cd.names, cd.data, box);
    });
    // keep the charts in their order whatever arrived first
    keys.forEach(function (k) { holder.appendChild(charts[k].root.parentNode); });
  }
  function clearCharts() {
    Object.keys(charts).forEach(function (k) { charts[k].destroy(); charts[k].root.parentNode.remove(); delete charts[k]; });
  }

  // -- the job page ----------------------------------------------------------------------------
  var view = { job: null, lastEvent: 0, metricsAt: 0, metricsState: null };
  var FINAL = { completed: 1, failed: 1, cancelled: 1 };
  function openJob(id) {
    if (view.job === id) return;
    view = { job: id, lastEvent: 0, metricsAt: 0, metricsState: null };
    clearCharts();
    $("events").textContent = "";
    $("job-msg").textContent = "";
    document.body.removeAttribute("data-job-loaded");
  }
  function renderJob(j) {
    $("job-title").textContent = "job " + j.id + (j.name && j.name !== j.id ? " (" + j.name + ")" : "") + " · " + j.kind;
    var st = $("job-state");
    st.textContent = j.state;
    st.className = "state " + j.state;
    $("job-reason").textContent = j.pending_reason || (j.state === "failed" && j.error ? j.error : "");
    var p = $("job-progress");
    p.textContent = "";
    progressCell(j).childNodes.forEach(function (n) { p.appendChild(n.cloneNode(true)); });
    $("job-samples").textContent = (j.samples_done || 0) + "/" + (j.samples_total || "?");
    $("job-loss").textContent = fmtNum(j.loss, 4);
    $("job-eta").textContent = j.state === "running" ? fmtEta(j.eta_s) : "–";
    $("job-nodes").textContent = (j.nodes || []).join(", ") || "–";
    $("btn-pause").disabled = !(j.state === "running" || j.state === "pending");
    $("btn-resume").disabled = j.state !== "paused";
    $("btn-cancel").disabled = !!FINAL[j.state];
    var nodes = [];
    (j.tasks || []).forEach(function (t) { if (t.node_name && nodes.indexOf(t.node_name) < 0) nodes.push(t.node_name); });
    fillChoices("log-node", nodes.sort());  // the log view's node filter: where this job's tasks ran
    var body = document.querySelector("#tasks tbody");
    body.textContent = "";
    (j.tasks || []).forEach(function (t) {
      var tr = el("tr");
      tr.setAttribute("data-task", t.id);
      tr.appendChild(el("td", t.id));
      tr.appendChild(el("td", t.kind));
      tr.appendChild(el("td", t.rank === null || t.rank === undefined ? "–" : t.rank));
      tr.appendChild(el("td", t.node_name || "–"));
      tr.appendChild(el("td", t.state, "state " + t.state));
      tr.appendChild(el("td", t.attempt));
      tr.appendChild(el("td", t.error || ""));
      body.appendChild(tr);
    });
  }
  function appendEvents(events) {
    var list = $("events");
    events.forEach(function (e) {
      view.lastEvent = Math.max(view.lastEvent, e.id);
      var t = new Date(e.ts * 1000);
      var li = el("li", t.toLocaleTimeString() + " [" + e.kind + "] " + e.message);
      li.setAttribute("data-event", e.kind);
      list.appendChild(li);
    });
    while (list.childNodes.length > MAX_EVENTS) list.removeChild(list.firstChild);
    if (events.length) list.scrollTop = list.scrollHeight;
  }
  function refreshJob() {
    var id = view.job;
    return api("GET", jobPath(id)).then(function (j) {
      if (view.job !== id) return null;
      renderJob(j);
      var now = Date.now();
      var wantMetrics = j.state !== view.metricsState || (j.state === "running" && now - view.metricsAt >= METRICS_EVERY_MS);
      return Promise.all([
        api("GET", jobPath(id, "/events?since=" + view.lastEvent)),
        wantMetrics ? api("GET", jobPath(id, "/metrics")) : null,
        api("GET", "/api/v1/auth/check"),
      ]).then(function (got) {
        if (view.job !== id) return;
        renderCoordinator(got[2]);
        appendEvents(got[0] || []);
        if (got[1]) {
          renderCharts(got[1]);
          view.metricsAt = now;
          view.metricsState = j.state;
        }
        document.body.setAttribute("data-job-loaded", j.state);
        return refreshLogs();
      });
    });
  }
  function control(action) {
    var id = view.job;
    if (!id) return;
    if (action === "cancel" && !window.confirm("Cancel job " + id + "? Its workers are stopped at once; a cancelled job cannot be resumed.")) return;
    var msg = $("job-msg");
    msg.className = "";
    msg.textContent = action + "…";
    api("POST", jobPath(id, "/" + action)).then(function (j) {
      // the answer is the job as the request left it (a pause lands after the next checkpoint)
      msg.textContent = action + " requested" + (j.state ? " (job " + j.state + ")" : "");
      refresh();
    }).catch(function (e) {
      msg.className = "bad";
      msg.textContent = e.message;
    });
  }
  ["pause", "resume", "cancel"].forEach(function (a) {
    $("btn-" + a).addEventListener("click", function () { control(a); });
  });

  // -- one refresh loop --------------------------------------------------------------------------
  var busy = false;
  function refresh() {
    if (!token) { showLogin(); return; }
    var id = fromHash("job");
    $("main").hidden = !!id;
    $("job-page").hidden = !id;
    if (id) openJob(id); else view.job = null;
    $("log-job-filter").hidden = !!id;  // the job page's log view is its job's
    if (busy) return;
    busy = true;
    (id ? refreshJob() : refreshOverview())
      .then(function () {
        $("error").textContent = "";
        document.body.setAttribute("data-loaded", "1");
      })
      .catch(function (e) {
        if (!token) showLogin(e.message); else $("error").textContent = e.message;
      })
      .then(function () { busy = false; });
  }
  window.addEventListener("hashchange", function () { takeToken(); refresh(); });
  refresh();
  setInterval(refresh, REFRESH_MS);
})();
