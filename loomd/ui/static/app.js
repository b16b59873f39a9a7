// loomd viewer: the CSRF token on every form, and the review queue's keyboard (j/k/a/e/x/r/m/s/o).
"use strict";
const csrf = document.querySelector('meta[name="csrf"]').content;

document.querySelectorAll('form[method="post"]').forEach((form) => {
  const field = document.createElement("input");
  field.type = "hidden"; field.name = "csrf"; field.value = csrf;
  form.appendChild(field);
});

async function post(path, fields) {
  const body = new URLSearchParams({csrf, ...fields});
  const reply = await fetch(path, {method: "POST", body, headers: {Accept: "application/json"},
                                   credentials: "same-origin"});
  const data = await reply.json();
  if (!data.ok) { alert(data.error); }
  return data.ok;
}

const queue = document.querySelector("ol.queue");
if (queue) {
  let at = 0;
  const cards = () => Array.from(queue.querySelectorAll(".card"));
  const select = (i) => {
    const all = cards();
    if (!all.length) { return; }
    at = Math.max(0, Math.min(i, all.length - 1));
    all.forEach((c, j) => c.classList.toggle("sel", j === at));
    all[at].scrollIntoView({block: "nearest"});
  };
  const done = (card, label) => {
    card.classList.add("done");
    card.querySelector("small").textContent += " · " + label;
    select(at + 1);
  };
  select(0);
  document.addEventListener("keydown", async (event) => {
    if (event.target.closest("input, textarea, select") || event.ctrlKey || event.metaKey || event.altKey) { return; }
    const card = cards()[at];
    if (!card) { return; }
    const id = card.dataset.id;
    switch (event.key) {
      case "j": select(at + 1); break;
      case "k": select(at - 1); break;
      case "o": location.href = "/memory/" + id; break;
      case "e": location.href = "/memory/" + id + "#edit"; break;
      case "a": if (await post("/memory/" + id + "/approve", {})) { done(card, "approved"); } break;
      case "x": if (await post("/memory/" + id + "/archive", {reason: "review"})) { done(card, "archived"); } break;
      case "r": if (await post("/memory/" + id + "/restore", {})) { done(card, "restored"); } break;
      case "m": {
        const other = prompt("Merge which memory ids into #" + id + "?");
        if (other && await post("/memory/" + id + "/merge", {other})) { done(card, "merged " + other); }
        break;
      }
      case "s": {
        const old = prompt("#" + id + " supersedes which memory ids?");
        if (old && await post("/memory/" + id + "/supersede", {old})) { done(card, "supersedes " + old); }
        break;
      }
      default: return;
    }
    event.preventDefault();
  });
}
