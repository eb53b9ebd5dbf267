// VRAM Guard: live memory readout and hover hints for the "VRAM Guard" accordion.
//
// Polls ./internal/vram-guard/status (JSON, see lib_vram/core/readout.py) about once a second while a job
// runs - detected from the WebUI's Interrupt buttons or the payload's job_running flag - and once
// after it ends, then swaps the payload's html into every readout (#vram_guard_readout_<tab>): the
// per-stage table and the memory timeline's SVG, which so grows while the job runs.
// When idle it refreshes an open readout every 10 s. The controls' hover hints (their explanation:
// labels are short) come with the readout's first HTML: each becomes the control's `title` (an
// accordion's: its header's) and, inside the WebUI, an entry of hints.js's `titles`.
// Every global name starts with "vramGuard";
// nothing here throws if the elements are missing (pages without the accordion, other tabs).

var vramGuardConfig = {
    url: "./internal/vram-guard/status",
    tabs: ["txt2img", "img2img", "extras"],
    busyMs: 1000,
    idleMs: 10000,
};

var vramGuardState = {
    timer: null,
    inFlight: false,
    wasBusy: false,
    lastFetch: 0,
    lastPayload: null,
    polls: 0,
    failures: 0,
    tooltipsDone: false,
};

function vramGuardRoot() {
    if (typeof gradioApp === "function") {
        try {
            return gradioApp();
        } catch (e) {
            // gradioApp() throws before <gradio-app> exists; fall through to the document.
        }
    }
    var app = document.querySelector("gradio-app");
    return (app && app.shadowRoot) || document;
}

function vramGuardReadouts() {
    var root = vramGuardRoot();
    return vramGuardConfig.tabs.map(function(tab) {
        return root.querySelector("#vram_guard_readout_" + tab);
    }).filter(Boolean);
}

function vramGuardIsVisible(el) {
    return !!(el && (el.offsetWidth || el.offsetHeight || el.getClientRects().length));
}

function vramGuardWebuiBusy() {
    // A1111/Forge show <tab>_interrupt only while that tab is generating (Extras too).
    var root = vramGuardRoot();
    return vramGuardConfig.tabs.some(function(tab) {
        var el = root.querySelector("#" + tab + "_interrupt");
        return !!(el && el.style && el.style.display === "block");
    });
}

function vramGuardRegisterTooltips(readouts) {
    if (vramGuardState.tooltipsDone) {
        return;
    }
    var root = vramGuardRoot();
    readouts.forEach(function(readout) {
        var box = readout.querySelector("[data-vram-guard-tooltips]");
        if (!box) {
            return;
        }
        var tips;
        try {
            tips = JSON.parse(box.getAttribute("data-vram-guard-tooltips"));
        } catch (e) {
            console.warn("VRAM Guard: bad tooltip data", e);
            return;
        }
        Object.keys(tips).forEach(function(id) {
            var label = tips[id][0];
            var tip = tips[id][1];
            // hints.js's titles[] keys on visible text anywhere on the page: only our own labels
            // (an empty one, e.g. "Advanced"'s, would give every such text our hint)
            if (label && typeof titles === "object" && titles !== null && !(label in titles)) {
                titles[label] = tip;
            }
            var el = root.querySelector("#" + CSS.escape(id));
            // an accordion ("Advanced", the WebUI's InputAccordion): its header, where its label is
            // (a title on the whole accordion would show over every control inside it)
            var target = el && (el.querySelector(":scope > .label-wrap") || el);
            if (target && !target.title) {
                target.title = tip;
            }
        });
        vramGuardState.tooltipsDone = true;
    });
}

function vramGuardApply(payload) {
    vramGuardState.lastPayload = payload;
    vramGuardReadouts().forEach(function(readout) {
        var box = readout.querySelector(".vram-guard-readout");
        if (!box) {
            return;
        }
        if (typeof payload.html === "string") {
            box.innerHTML = payload.html;
        }
        box.setAttribute("data-vram-guard-polls", String(vramGuardState.polls));
        box.setAttribute("data-job-running", payload.job_running ? "true" : "false");
    });
}

function vramGuardRefresh() {
    if (vramGuardState.inFlight || typeof fetch !== "function") {
        return Promise.resolve(null);
    }
    vramGuardState.inFlight = true;
    vramGuardState.lastFetch = Date.now();
    return fetch(vramGuardConfig.url, {cache: "no-store", headers: {Accept: "application/json"}})
        .then(function(resp) {
            if (!resp.ok) {
                throw new Error("HTTP " + resp.status);
            }
            return resp.json();
        })
        .then(function(payload) {
            vramGuardState.polls += 1;
            vramGuardState.failures = 0;
            vramGuardApply(payload);
            return payload;
        })
        .catch(function(err) {
            vramGuardState.failures += 1;
            if (vramGuardState.failures === 1) {
                console.warn("VRAM Guard: status request failed:", err);
            }
            return null;
        })
        .finally(function() {
            vramGuardState.inFlight = false;
        });
}

function vramGuardTick() {
    try {
        var readouts = vramGuardReadouts();
        if (!readouts.length) {
            return;
        }
        vramGuardRegisterTooltips(readouts);
        var last = vramGuardState.lastPayload;
        var busy = vramGuardWebuiBusy() || !!(last && last.job_running);
        var now = Date.now();
        // Back off after repeated failures (route missing, server restarting): at most every 30 s.
        var minGap = vramGuardState.failures > 2 ? 30000 : 0;
        if (now - vramGuardState.lastFetch < minGap) {
            return;
        }
        if (busy) {
            vramGuardState.wasBusy = true;
            vramGuardRefresh();
        } else if (vramGuardState.wasBusy || vramGuardState.polls === 0) {
            // Once after the job (its final per-stage peaks), and once at start.
            vramGuardState.wasBusy = false;
            vramGuardRefresh();
        } else if (now - vramGuardState.lastFetch >= vramGuardConfig.idleMs && readouts.some(vramGuardIsVisible)) {
            vramGuardRefresh();
        }
    } catch (e) {
        console.warn("VRAM Guard: readout update failed", e);
    }
}

if (vramGuardState.timer === null) {
    vramGuardState.timer = setInterval(vramGuardTick, vramGuardConfig.busyMs);
}
