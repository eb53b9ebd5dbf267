"""``python -m lib_vram bench soak``: the library-level soak (issue 31 item 4) and its summary."""

from __future__ import annotations

import json

import pytest

from lib_vram.__main__ import main
from lib_vram.cli.bench.soak import RSS_GROWTH, summary

KEYS = {
    "job",
    "kind",
    "lora",
    "ok",
    "error",
    "rss_bytes",
    "card_bytes_at_rest",
    "card_baseline_bytes",
    "seconds",
}


def test_the_quick_soak_runs_every_job_ok_with_the_card_at_its_baseline_and_rss_flat(capsys):
    """Mixed jobs (txt2img, img2img, hires fix, Extras; a LoRA merged in place every other round)
    on a checkpoint placed on an emulated card: each job without the LoRA equals the first of its
    kind bit for bit, each job with it differs, the card is back at the placed checkpoint's bytes
    after every job, RSS stays flat."""
    rc = main(["bench", "soak", "--quick", "--jobs", "12", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    records, last = lines[:-1], lines[-1]["summary"]
    assert rc == 0, (records, last)
    assert len(records) == 12 and all(set(r) == KEYS for r in records)
    assert all(r["ok"] for r in records), [r for r in records if not r["ok"]]
    assert {r["kind"] for r in records} == {"txt2img", "img2img", "hires", "extras"}
    assert any(r["lora"] for r in records) and any(not r["lora"] for r in records)
    assert all(r["card_bytes_at_rest"] == r["card_baseline_bytes"] for r in records)
    assert last["passed"] and last["rss_growth_after_job_10"] <= RSS_GROWTH


def test_the_summary_fails_a_soak_that_grows_or_leaves_something_on_the_card():
    rec = dict.fromkeys(KEYS)
    one = dict(rec, ok=True, rss_bytes=100, card_bytes_at_rest=5, card_baseline_bytes=5, seconds=1.0)
    rows = [dict(one, job=i + 1)
            for i in range(20)]  # fmt: skip
    assert summary(rows)["rss_growth_after_job_10"] == 0 and summary(rows)["card_at_baseline"]
    rows[-1] = dict(rows[-1], rss_bytes=106, card_bytes_at_rest=6)
    s = summary(rows)
    assert s["rss_growth_after_job_10"] > RSS_GROWTH and not s["card_at_baseline"]


def test_a_webui_soak_settles_its_baseline_in_the_first_round_then_may_not_grow():
    # The WebUI keeps its last conditioning etc. on the card: above the placed bytes, but flat after
    rec = dict.fromkeys(KEYS)
    one = dict(rec, ok=True, rss_bytes=100, card_baseline_bytes=5, seconds=1.0)
    rows = [dict(one, job=i + 1, card_bytes_at_rest=7 if i % 4 == 2 else 6) for i in range(20)]
    rows[5] = dict(rows[5], card_bytes_at_rest=None)  # read while another client's job ran
    assert not summary(rows)["card_at_baseline"]  # (the library's rule: nothing above the placed bytes)
    s = summary(rows, settle=8)
    assert s["card_at_baseline"] and s["card_settled_bytes"] == 7
    rows[-1] = dict(rows[-1], card_bytes_at_rest=8)
    assert not summary(rows, settle=8)["card_at_baseline"]


def test_soak_needs_one_of_quick_or_url():
    with pytest.raises(SystemExit, match="--quick .* or --url"):
        main(["bench", "soak", "--jobs", "10"])


def test_a_webui_job_whose_status_read_fails_is_a_failed_record_not_a_lost_one(capsys):
    """Against a local HTTP server answering the API routes: when the status route fails once,
    that job still has its record (not ok, the route named) and the soak fails."""
    import http.server
    import threading

    calls = {"status": 0}

    class Api(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.endswith("/status"):
                calls["status"] += 1
                if calls["status"] == 3:
                    self.send_error(500)
                    return
            body = json.dumps(
                {"card": {"used_bytes": 0, "resident_bytes": 0}} if "status" in self.path else {}
            )
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc = main(
            ["bench", "soak", "--url", f"http://127.0.0.1:{server.server_port}", "--jobs", "10", "--json"]
        )
    finally:
        server.shutdown()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    records, last = lines[:-1], lines[-1]["summary"]
    assert rc == 1 and not last["passed"]
    assert [r["job"] for r in records] == list(range(1, 11)) and all(set(r) == KEYS for r in records)
    failed = [r for r in records if not r["ok"]]
    assert [r["job"] for r in failed] == [3] and failed[0]["error"].startswith("status route:")
