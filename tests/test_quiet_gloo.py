"""gloo's "[Gloo] Rank N is connected to M peer ranks" lines kept off stdout (jaxdp.cluster.quiet.filter_gloo_lines).

gloo prints them from C++ straight to fd 1, from one thread per device at the same moment, so
their pieces interleave. A tiny subprocess writes such lines to fd 1 the same way, between
ordinary output from Python and from the fd."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import ROOT

from jaxdp.cluster.quiet import is_gloo_line

LINE = "[Gloo] Rank {r} is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"

SCRIPT = textwrap.dedent('''
    import os, sys
    from jaxdp.cluster import quiet
    quiet.filter_gloo_lines(enabled=sys.argv[1] == "on")
    print("before", flush=True)
    os.write(1, {line0!r}.encode())
    # Two devices' messages, their pieces interleaved as gloo's threads write them.
    for piece in ("[Gloo] Rank ", "[Gloo] Rank ", "1", " is connected to ", "2", " is connected to ", "7",
                  " peer ranks. ", "7 peer ranks. Expected number of connected peer ranks is : 7\\n",
                  "Expected number of connected peer ranks is : ", "7", "\\n"):
        os.write(1, piece.encode())
    os.write(1, b"a line from C: [Gloo] Rank 0 is connected to nothing, kept\\n")
    os.write(1, b"12345\\n")
    print("after, without a newline", end="")
''').format(line0=LINE.format(r=0))


def run(mode: str) -> str:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env,
                          timeout=60, check=True).stdout


def test_gloo_lines_are_dropped_and_everything_else_kept_in_order():
    assert run("on") == ("before\na line from C: [Gloo] Rank 0 is connected to nothing, kept\n12345\n"
                         "after, without a newline")
    unfiltered = run("off")  # --debug: stdout as it was
    assert unfiltered.count("[Gloo] Rank") == 4 and unfiltered.endswith("after, without a newline")


def test_what_counts_as_a_gloo_line():
    assert is_gloo_line(LINE.format(r=5).rstrip("\n").encode())
    assert is_gloo_line(b"7 peer ranks. Expected number of connected peer ranks is : 7")
    assert not is_gloo_line(b"12345") and not is_gloo_line(b"[Gloo] Rank 0 is connected to nothing")


def test_http_access_lines_are_dropped_and_errors_kept(capsys, monkeypatch):
    """torchft's checkpoint server logs each state transfer through http.server's access line:
    quiet_http_requests drops those lines (without --debug) and keeps its error lines."""
    import http.server
    import threading
    import urllib.error
    import urllib.request

    from jaxdp.cluster import quiet

    handler = http.server.BaseHTTPRequestHandler
    monkeypatch.setattr(handler, "log_request", handler.log_request)  # (put back after the test)

    class Serve(handler):
        def do_GET(self):
            if self.path == "/fail":
                self.send_error(500, "no state here")
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"state")

    def get(server, path):
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}{path}", timeout=10).read()
        except urllib.error.HTTPError as err:
            return err.code

    server = http.server.HTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert get(server, "/checkpoint/1/full") == b"state"
        assert '"GET /checkpoint/1/full HTTP/1.1" 200' in capsys.readouterr().err  # the access line, by default
        quiet.quiet_http_requests()
        assert get(server, "/checkpoint/2/full") == b"state" and get(server, "/fail") == 500
        err = capsys.readouterr().err
        assert "/checkpoint/2/full" not in err and "no state here" in err, err
    finally:
        server.shutdown()
        server.server_close()
