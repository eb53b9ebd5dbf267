"""'Profile the next job' in the real WebUI (run by hand against a running WebUI; not a pytest test).

    python tests/acceptance/webui_profile_check.py http://127.0.0.1:7871 [--auth user:pass]

1. clicks the accordion's 'Profile the next job' through the page's own event route
   (``/run/predict`` with the button's ``fn_index`` from ``/config``): the readout says it is armed;
2. runs a 128² txt2img (2 steps) with VRAM Guard on (``vae_tiling`` Always) through the API;
3. reads ``/vram-guard/v1/status``: the decode's top operators and its files;
4. fetches each file through the page's ``file=`` route (200; the summary parses) and checks that a
   second job is not profiled (the switch turned itself off);
5. removes the files it made. Prints one JSON object; exit 1 when a check failed.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import urllib.parse
import urllib.request


def call(base: str, path: str, body: object = None, auth: str | None = None, raw: bool = False):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="POST" if body is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            payload = r.read()
            return r.status, (payload if raw else json.loads(payload))
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()[:300]


def main() -> int:
    base = sys.argv[1].rstrip("/")
    auth = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--auth" else None
    checks: dict[str, object] = {}
    _, config = call(base, "/config")
    ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    button = next(i for i, e in ids.items() if e == "vram_guard_txt2img_profile")
    fn_index = next(
        i
        for i, d in enumerate(config["dependencies"])
        if button in d["targets"] and d.get("trigger") == "click"
    )
    status, out = call(base, "/run/predict", {"fn_index": fn_index, "data": [], "session_hash": "vgprofile"})
    checks["click_status"] = status
    checks["armed_in_readout"] = status == 200 and "Profiling armed" in out["data"][0]
    _, st = call(base, "/vram-guard/v1/status", auth=auth)
    checks["armed_in_status"] = st["profile"]["armed"]
    job = {
        "prompt": "a lighthouse",
        "steps": 2,
        "width": 128,
        "height": 128,
        "alwayson_scripts": {"VRAM Guard": {"args": [{"vae_tiling": "Always", "vae_tile": 16}]}},
    }
    status, res = call(base, "/sdapi/v1/txt2img", job, auth=auth)
    checks["txt2img_status"] = status
    _, st = call(base, "/vram-guard/v1/status", auth=auth)
    last = st["profile"]["last"] or {}
    stages = last.get("stages", [])
    checks["armed_after_job"] = st["profile"]["armed"]
    checks["stages"] = [
        {
            "stage": s["stage"],
            "ok": s["ok"],
            "top": [(o["name"], o["calls"], o["alloc_bytes"]) for o in s["top"][:5]],
            "peak_bytes": s["peak_bytes"],
            "files": s["files"],
        }
        for s in stages
    ]
    checks["link_in_html"] = 'href="file=' in st["html"]
    served = {}
    for s in stages:
        for kind, path in s["files"].items():
            code, body = call(base, "/file=" + urllib.parse.quote(path), raw=True)
            served[kind] = code
            if kind == "summary" and code == 200:
                checks["summary_top"] = json.loads(body)["ops"][0]["name"]
    checks["served"] = served
    status, res = call(base, "/sdapi/v1/txt2img", job, auth=auth)
    _, st2 = call(base, "/vram-guard/v1/status", auth=auth)
    checks["second_job_not_profiled"] = st2["profile"]["last"] == st["profile"]["last"]
    for s in stages:  # the shared WebUI's outputs folder: leave nothing of ours there
        for path in s["files"].values():
            if os.path.isfile(path):
                os.remove(path)
    folder = last.get("folder")
    if folder and os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)
    ok = (
        checks["armed_in_readout"]
        and checks["armed_in_status"]
        and not checks["armed_after_job"]
        and stages
        and all(s["ok"] for s in stages)
        and any(op["name"] == "aten::conv2d" for s in stages for op in s["top"][:3])
        and served
        and all(c == 200 for c in served.values())
        and checks["link_in_html"]
        and checks["second_job_not_profiled"]
    )
    checks["ok"] = bool(ok)
    print(json.dumps(checks, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
