"""`dataflow serve` of a plan directory inside this process, for the tests and the serving benchmarks
(benchmarks/serve_bench.py): uvicorn on a thread, the ranks as processes, as the command starts them."""
from __future__ import annotations

import contextlib
from pathlib import Path


@contextlib.contextmanager
def serve_in_thread(plan_dir: Path, *, startup_timeout_s: float = 900.0, **options):
    """Yields (base url, Server) once /health answers 200; shuts it down after (bounded)."""
    import socket
    import threading
    import time
    import urllib.request

    import uvicorn

    from dataflow.cmd_serve import build_server
    from dataflow.openai_api import create_app
    server, _ = build_server(plan_dir, **options)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=http.run, name="dataflow-serve", daemon=True)
    th.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as res:
                if res.status == 200:
                    break
        except OSError:  # (refused before it listens; 503 while the ranks start)
            pass
        if not th.is_alive():
            raise RuntimeError(f"the server failed to start: {server.front.failure or 'see its log above'}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not become healthy in {startup_timeout_s:g} s")
        time.sleep(0.2)
    try:
        yield base, server
    finally:
        http.should_exit = True
        th.join(60)
        if th.is_alive():
            raise RuntimeError("the server did not shut down within 60 s")
