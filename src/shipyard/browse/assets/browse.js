// shipyard browse: chart read-outs, the batch step picker and the model / trace forms. Text from
// the server is inserted with textContent only (never innerHTML), so a document cannot run code.
"use strict";

function readouts() {
  for (const svg of document.querySelectorAll("svg[data-chart]")) {
    const d = JSON.parse(svg.dataset.chart);
    const out = svg.parentElement.querySelector("output.readout");
    const width = svg.viewBox.baseVal.width;
    svg.addEventListener("mousemove", (ev) => {
      const box = svg.getBoundingClientRect();
      const px = (ev.clientX - box.left) * width / box.width;
      const x = d.x[0] + (px - d.pad) / (width - 2 * d.pad) * (d.x[1] - d.x[0]);
      const parts = [];
      for (const [name, pts] of Object.entries(d.series)) {
        let best = null;
        for (const p of pts) if (best === null || Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
        if (best) parts.push(`${name} at ${best[0]}: ${Number(best[1]).toPrecision(5)}`);
      }
      out.textContent = parts.join("   ");
    });
  }
}

function stepPicker() {
  for (const form of document.querySelectorAll("form.step")) {
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const step = Math.max(0, parseInt(form.elements.step.value || "0", 10));
      window.location.href = form.dataset.base + step + ".html";
    });
  }
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function showCompletion(target, r) {
  target.replaceChildren();
  const line = el("p");
  for (const t of r.tokens) {
    const span = el("span", t.text, "tok");
    span.title = t.top.map((a) => `${JSON.stringify(a.text)} ${a.logprob.toFixed(3)}`).join("\n");
    line.append(span, el("span", t.logprob.toFixed(2), "lp"));
  }
  target.append(el("pre", r.prompt), line);
  const facts = el("p");
  const model = el("a", r.model.name);
  model.href = r.model.page;
  facts.append("model ", model, `: params sha256 ${r.model.params_sha256}, checkpoint ${r.model.checkpoint}; trained on `);
  for (const s of r.model.shards) {
    const shard = el(s.page ? "a" : "code", s.path);
    if (s.page) shard.href = s.page;
    facts.append(shard, " ");
  }
  target.append(facts);
}

function showTrace(target, r) {
  target.replaceChildren(el("p", `${r.spans.length} span(s) of ${r.tokens} tokens found in ${r.shards}`));
  for (const s of r.spans) {
    const box = el("div", undefined, "span");
    box.append(el("h3", `"${s.text}" — ${s.count} occurrence(s)`));
    for (const m of s.matches) {
      const pre = el("pre", undefined, "doc");
      pre.append(document.createTextNode(m.before), el("mark", m.match), document.createTextNode(m.after));
      box.append(el("p", `shard ${m.shard}, document ${m.document}`), pre);
    }
    target.append(box);
  }
}

function apiForms() {
  for (const form of document.querySelectorAll("form.api")) {
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const target = form.nextElementSibling;
      target.textContent = "working…";
      const body = Object.fromEntries(new FormData(form).entries());
      try {
        const res = await fetch(form.dataset.api, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) });
        const r = await res.json();
        if (!res.ok) { target.textContent = r.detail || res.statusText; return; }
        (form.id === "trace" ? showTrace : showCompletion)(target, r);
      } catch (e) {
        target.textContent = "no server answers here: open this page through `shipyard browse` (" + e + ")";
      }
    });
  }
}

document.addEventListener("DOMContentLoaded", () => { readouts(); stepPicker(); apiForms(); });
