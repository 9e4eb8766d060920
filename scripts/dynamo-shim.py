#!/usr/bin/env python3
"""kvroute bench harness: a thin forwarding shim that puts NVIDIA Dynamo's selection service
(ai-dynamo 1.6.1, `python -m dynamo.select_service`) in front of kvroute engine-sim workers, so
that `kvroute bench compare` can run Dynamo's KV router as a peer (ai-dynamo 1.6.1 from PyPI, github.com/ai-dynamo/dynamo;
installed by scripts/compare-peers.sh).

It is part of the benchmark harness, not of kvroute, and not something Dynamo ships: Dynamo's own
frontend cannot route to plain HTTP workers, its selection service only chooses one. Per request:

  1. the prompt's token ids, computed exactly as the engine-sim computes the ids it hashes and
     publishes in its KV events (the chat messages' contents, or the completion prompt,
     concatenated and cut at 1 MiB, then 4 bytes per id, little-endian; a completion prompt of
     token ids is taken as is): the engine-sim has no real tokenizer, so no tokenizer here either;
  2. `POST /select_and_reserve {"model_name", "token_ids"}` on the selection service;
  3. the request body, untouched, forwarded to the chosen worker and its answer relayed (streamed
     or not);
  4. `POST /reservations/{id}/prefill_complete` at the answer's first byte and
     `DELETE /reservations/{id}` at its end.

The shim starts the selection service itself (on 127.0.0.1:--select-port; the service binds every
interface, all traffic here goes to 127.0.0.1) and registers every worker with its ZeroMQ KV-event
endpoint (engine-sim `--kv-events tcp://… --kv-encoding legacy`: Dynamo decodes vLLM's
positional msgpack batches). The service dies with the shim (PR_SET_PDEATHSIG).

Its latency is the shim's (Python, aiohttp, one extra HTTP hop to the selection service) as much
as Dynamo's: report routing quality and overhead separately.

usage: dynamo-shim.py --port P --select-port Q --model M --worker URL=tcp://127.0.0.1:K [...]
Runs with the Dynamo venv's python (aiohttp comes with it).
"""
import argparse
import array
import asyncio
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
from aiohttp import web

MAX_ROUTING_TEXT = 1 << 20  # kvroute_protocol::openai::MAX_ROUTING_TEXT


def _cut(out, s):
    """Appends s to the bytearray out, up to MAX_ROUTING_TEXT bytes on a character boundary."""
    room = MAX_ROUTING_TEXT - len(out)
    if room <= 0:
        return
    b = s.encode()
    if len(b) > room:
        end = room
        while end > 0 and (b[end] & 0xC0) == 0x80:
            end -= 1
        b = b[:end]
    out += b


def token_ids(path, body):
    """The token ids the engine-sim hashes for this request (see the module doc)."""
    text = bytearray()
    if path.endswith("/chat/completions"):
        for m in body.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                _cut(text, c)
            elif isinstance(c, list):
                for p in c:
                    if isinstance(p, dict) and isinstance(p.get("text"), str):
                        _cut(text, p["text"])
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            _cut(text, p)
        elif isinstance(p, list) and p and isinstance(p[0], int):
            return p
        elif isinstance(p, list):
            for s in p:
                if isinstance(s, str):
                    _cut(text, s)
    text += b"\0" * (-len(text) % 4)
    a = array.array("I")
    a.frombytes(bytes(text))
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def _die_with_parent():
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Shim:
    def __init__(self, args):
        self.args = args
        self.select = f"http://127.0.0.1:{args.select_port}"
        self.session = None
        self.proc = None

    async def start(self, app):
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        env.setdefault("DYN_LOG", "warn")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.select_service", "--port", str(self.args.select_port),
             "--threads", str(self.args.threads)],
            stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False)
        deadline = time.monotonic() + 60
        while True:
            try:
                async with self.session.get(f"{self.select}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                await self.stop(app)
                raise SystemExit(f"dynamo-shim: the selection service did not start (exit {self.proc.poll()})")
            await asyncio.sleep(0.1)
        for i, w in enumerate(self.args.worker):
            url, kv = w.split("=", 1)
            reg = {"worker_id": i + 1, "model_name": self.args.model, "endpoint": url,
                   "block_size": self.args.block_size, "kv_events_endpoints": {"0": kv}}
            async with self.session.post(f"{self.select}/workers", json=reg) as r:
                if r.status // 100 != 2:
                    await self.stop(app)
                    raise SystemExit(f"dynamo-shim: registering {url}: HTTP {r.status} {await r.text()}")
        print(f"dynamo-shim: {len(self.args.worker)} workers registered with the selection service on "
              f"{self.select}; serving on 127.0.0.1:{self.args.port}", file=sys.stderr, flush=True)

    async def stop(self, app):
        if self.session:
            await self.session.close()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    async def _release(self, sid, prefilled):
        try:
            if not prefilled:
                async with self.session.post(f"{self.select}/reservations/{sid}/prefill_complete") as r:
                    await r.read()
            async with self.session.delete(f"{self.select}/reservations/{sid}") as r:
                await r.read()
        except aiohttp.ClientError as e:
            print(f"dynamo-shim: releasing {sid}: {e}", file=sys.stderr, flush=True)

    async def _prefill_complete(self, sid):
        try:
            async with self.session.post(f"{self.select}/reservations/{sid}/prefill_complete") as r:
                await r.read()
        except aiohttp.ClientError as e:
            print(f"dynamo-shim: prefill_complete {sid}: {e}", file=sys.stderr, flush=True)

    async def forward(self, request):
        raw = await request.read()
        try:
            body = json.loads(raw)
            ids = token_ids(request.path, body)
        except (ValueError, AttributeError, TypeError) as e:
            return web.json_response({"error": {"message": f"dynamo-shim: bad request: {e}"}}, status=400)
        async with self.session.post(f"{self.select}/select_and_reserve",
                                     json={"model_name": self.args.model, "token_ids": ids}) as r:
            sel = await r.json(content_type=None)
            if r.status != 200:
                return web.json_response({"error": {"message": f"dynamo selection failed: {sel}"}}, status=503)
        sid, endpoint = sel["selection_id"], sel["endpoint"]
        prefill = None
        try:
            async with self.session.post(endpoint + request.path, data=raw,
                                         headers={"content-type": "application/json"}) as up:
                ctype = up.headers.get("content-type", "application/json")
                if body.get("stream") is True and up.status == 200:
                    out = web.StreamResponse(status=200, headers={"content-type": ctype, "cache-control": "no-cache"})
                    await out.prepare(request)
                    async for chunk in up.content.iter_any():
                        if prefill is None:
                            prefill = asyncio.ensure_future(self._prefill_complete(sid))
                        await out.write(chunk)
                    await out.write_eof()
                    return out
                data = await up.read()
                return web.Response(body=data, status=up.status, headers={"content-type": ctype})
        except aiohttp.ClientError as e:
            return web.json_response({"error": {"message": f"dynamo-shim: worker {endpoint}: {e}"}}, status=502)
        finally:
            asyncio.ensure_future(self._finish(sid, prefill))

    async def _finish(self, sid, prefill):
        if prefill is not None:
            await prefill
        await self._release(sid, prefill is not None)

    async def health(self, request):
        return web.json_response({"status": "ok"})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True, help="listen port (127.0.0.1)")
    ap.add_argument("--select-port", type=int, required=True, help="port for dynamo.select_service")
    ap.add_argument("--model", required=True, help="model name the workers serve")
    ap.add_argument("--worker", action="append", required=True, metavar="URL=ZMQ",
                    help="a worker and its KV-event endpoint, e.g. http://127.0.0.1:8001=tcp://127.0.0.1:5601")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size of the workers (engine-sim: 16)")
    ap.add_argument("--threads", type=int, default=2, help="selection service KV indexer threads")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    shim = Shim(args)
    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(shim.start)
    app.on_cleanup.append(shim.stop)
    app.router.add_post("/v1/chat/completions", shim.forward)
    app.router.add_post("/v1/completions", shim.forward)
    app.router.add_get("/health", shim.health)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None,
                handle_signals=True)


if __name__ == "__main__":
    main()
