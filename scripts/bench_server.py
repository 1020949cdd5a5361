"""Throughput of ``specdraft serve`` at several concurrency levels, with and without a drafter.

For each drafter, starts a server on loopback (a free port) with the given target, sends
a fixed number of streamed chat requests (MT-Bench first turns, greedy) at each
concurrency level, stops the server with SIGTERM, and prints a Markdown table:

    requests/s   finished requests / wall seconds of the level
    tokens/s     completion tokens (from each response's usage) / wall seconds
    tok/req      mean completion tokens per request: in bfloat16 two servers' greedy texts may part
                 at near-ties and end at different lengths, which moves tokens/s without any change
                 in speed; ``--ignore-eos`` makes every answer max_tokens long so rates compare speed
    τ            mean tokens per target forward of the level's requests (from /metrics)
    p50/p95 latency, p50 TTFT  per request, seconds

Everything stays on 127.0.0.1 and every level sends a bounded number of requests.

    .venv/bin/python scripts/bench_server.py --drafters none,lookup --concurrency 1,4,16 --requests 32 --rounds 3
    # fewer requests where they are slow, the table rewritten after every round:
    .venv/bin/python scripts/bench_server.py --requests 8,16,16 --rounds 4 --out runs/server.md

Rounds are interleaved (every level of every drafter once per round, every second round in
reverse drafter order, so a machine drifting within a level favours no drafter); ``vs none``
is the median of the per-round ratios to plain decoding at the same level, listed after it.
With ``--wave N`` a level is interleaved finer: its requests go out in chunks of N x
concurrency, each chunk to every server in turn (the order rotating from chunk to chunk),
and a server's rates are over its chunks' summed wall time. On a VM whose speed moves by
10-20% within a minute that pairs each drafter with plain decoding seconds apart rather
than a level apart; the price is that every chunk starts and drains its batch (no steady
continuous batching across chunks).
    # smoke test with a tiny model: --target PATH --completions --max-tokens 8 --requests 4
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from urllib.parse import urlparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="passed to specdraft serve (auto: bfloat16 where the CPU has it)")
    ap.add_argument("--drafters", default="none,lookup",
                    help="comma-separated --drafter specs; SPEC@compiled serves SPEC with --compile-drafter, "
                         "SPEC@no-int8 with --no-int8-drafter")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    ap.add_argument("--requests", default="32",
                    help="requests per level (at least the concurrency): one number, or one per level (8,16,32)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every answer max_tokens long (greedy texts that part at bfloat16 near-ties end "
                         "at different lengths otherwise, and tokens/s then compares texts, not speed)")
    ap.add_argument("--completions", action="store_true",
                    help="use /v1/completions with raw prompts (for targets without a chat template)")
    ap.add_argument("--out", help="also write the table here after every round (medians of the rounds so far), "
                                  "so a run stopped early keeps what it measured")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    ap.add_argument("--wave", type=int, default=0,
                    help="interleave within a level: the level's requests in chunks of WAVE x concurrency, each chunk "
                         "sent to every server in turn (rotating order) before the next; 0: each server sends all "
                         "of its level's requests in one go (steady continuous batching, coarser interleaving)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every (drafter, level) this many times, interleaved (all servers stay up, "
                         "idle between their turns); the table gives medians")
    args = ap.parse_args()
    if args.out:  # written after every round: a missing folder must not lose the first one
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) not in (1, len(levels)):
        sys.exit(f"--requests: one number or one per level ({len(levels)}), got {args.requests}")
    requests = dict(zip(levels, counts * len(levels) if len(counts) == 1 else counts))
    drafters = args.drafters.split(",")
    prompts = load_prompts()
    runs: dict[tuple[str, int], list[dict]] = {(d, c): [] for d in drafters for c in levels}
    with ExitStack() as stack:
        servers = {d: stack.enter_context(Server(args, d)) for d in drafters}
        for server in servers.values():
            send(server.url, args, prompts[0])  # warm-up (first-call allocations)
        for r in range(args.rounds):  # interleaved: a slow spell of the machine hits every row alike
            for c in levels:
                # every second round runs the drafters in reverse order: a machine drifting
                # faster or slower within a level then favours no drafter over the medians
                order = drafters if r % 2 == 0 else drafters[::-1]
                chosen = [prompts[i % len(prompts)] for i in range(max(requests[c], c))]
                size = args.wave * c or len(chosen)
                parts: dict[str, list[dict]] = {d: [] for d in drafters}
                for k, start in enumerate(range(0, len(chosen), size)):
                    for d in order[k % len(order):] + order[:k % len(order)]:
                        parts[d].append(send_chunk(servers[d].url, args, chosen[start:start + size], c))
                for d in order:
                    run = summarise(parts[d])
                    runs[(d, c)].append(run)
                    print(f"done: round {r + 1}, drafter {d}, concurrency {c}: {run['tps']:.1f} tokens/s, "
                          f"τ {run['tau']:.2f}", file=sys.stderr, flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    print_table(args, table_rows(runs, drafters, levels), r + 1, f)
    print_table(args, table_rows(runs, drafters, levels), args.rounds)


def table_rows(runs: dict, drafters: list[str], levels: list[int]) -> list[tuple]:
    return [(d, c, median_run(runs[(d, c)], runs.get(("none", c)))) for d in drafters for c in levels]


def median_run(runs: list[dict], plain: list[dict] | None) -> dict:
    """Medians over rounds; ``vs_none``: the median of per-round tokens/s ratios to plain
    decoding's run of the same round and level (None without a ``none`` row)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "requests"}
    out["requests"] = runs[0]["requests"]
    out["rounds"] = len(runs)
    out["vs_none"] = statistics.median(r["tps"] / p["tps"] for r, p in zip(runs, plain)) if plain else None
    out["vs_none_rounds"] = [r["tps"] / p["tps"] for r, p in zip(runs, plain)] if plain else []
    return out


def load_prompts() -> list[str]:
    from specdraft.prompts import mtbench_first_turns

    return [q["prompt"] for q in mtbench_first_turns()]


class Server:
    """``specdraft serve`` in a subprocess on 127.0.0.1:<free port>; SIGTERM on exit."""

    def __init__(self, args, drafter: str):
        # DRAFTER@compiled / DRAFTER@no-int8: the same drafter served with --compile-drafter /
        # --no-int8-drafter (its own row); the suffix is bench's (specdraft.bench.specs), of
        # which a server takes only those two
        from specdraft.bench.specs import split_shape

        drafter, shape = split_shape(drafter)
        if set(shape) - {"compiled", "int8"}:
            raise SystemExit(f"bench_server: {drafter}: only the @compiled and @no-int8 suffixes apply to a server")
        self.cmd = serve_command() + ["--compile-drafter"] * shape.get("compiled", False) + [
            "--no-int8-drafter"] * (not shape.get("int8", True)) + [
            "--target", args.target, "--device", args.device, "--dtype", args.dtype, "--drafter", drafter,
            "--host", "127.0.0.1", "--port", "0", "--max-batch-size", str(args.max_batch_size),
            "--max-queue", str(max([64] + [int(x) for x in args.requests.split(",")])), "--model-name", "bench", "--log-level", "warning",
            "--request-timeout", str(args.timeout)]

    def __enter__(self) -> "Server":
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, text=True)
        seen = []
        for line in self.proc.stderr:  # "specdraft: serving NAME (drafter D, DTYPE, linear L) on http://HOST:PORT"
            if line.startswith("specdraft: serving "):
                self.url = line.rsplit(" on ", 1)[1].strip()
                print("started:", line.strip().removeprefix("specdraft: "), flush=True)  # dtype, layout
                # Keep reading its log, or a full pipe would block the server.
                threading.Thread(target=self.proc.stderr.read, daemon=True).start()
                return self
            seen.append(line)
        self.proc.wait()
        raise SystemExit("the server did not start:\n" + "".join(seen))

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def serve_command() -> list[str]:
    return [sys.executable, "-m", "specdraft", "serve"]


def send(url: str, args, prompt: str) -> dict:
    """One streamed greedy request: {'tokens', 'latency', 'ttft'}."""
    body = {"model": "bench", "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # our server's extension (as vLLM's): every answer max_tokens long
    if args.completions:
        path, body["prompt"] = "/v1/completions", prompt
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=args.timeout)
    start = time.perf_counter()
    ttft, tokens = None, None
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    finally:
        conn.close()
    return {"tokens": tokens or 0, "latency": time.perf_counter() - start, "ttft": ttft or 0.0}


def tau_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the server's tokens-per-step histogram."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for line in text.splitlines():
        if line.startswith("specdraft_tokens_per_step_sum") or line.startswith("specdraft_tokens_per_step_count"):
            name, value = line.split()
            values[name] = float(value)
    return values.get("specdraft_tokens_per_step_sum", 0.0), values.get("specdraft_tokens_per_step_count", 0.0)


def send_chunk(url: str, args, chosen: list[str], concurrency: int) -> dict:
    """Send ``chosen`` with ``concurrency`` clients; per-request results, wall seconds and
    the server's tokens-per-step (sum, count) over the chunk."""
    tau_before = tau_totals(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: send(url, args, p), chosen))
    wall = time.perf_counter() - start
    tau_after = tau_totals(url)
    return {"results": results, "wall": wall, "tau": (tau_after[0] - tau_before[0], tau_after[1] - tau_before[1])}


def summarise(chunks: list[dict]) -> dict:
    """One server's run of a level from its chunks: rates over the chunks' summed wall time."""
    results = [r for c in chunks for r in c["results"]]
    wall = sum(c["wall"] for c in chunks)
    n, steps = len(results), sum(c["tau"][1] for c in chunks)
    latencies = sorted(r["latency"] for r in results)
    return {
        "requests": n, "wall": wall, "rps": n / wall, "tps": sum(r["tokens"] for r in results) / wall,
        "per_request": sum(r["tokens"] for r in results) / max(n, 1),
        "tau": sum(c["tau"][0] for c in chunks) / steps if steps else float("nan"),
        "p50": statistics.median(latencies), "p95": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
        "ttft": statistics.median(r["ttft"] for r in results),
    }


def print_table(args, rows, rounds: int, file=None) -> None:
    """The Markdown table; ``vs none`` is the median of per-round ratios, each listed after it."""
    from specdraft.models import resolve_dtype

    file = file or sys.stdout

    dtype = resolve_dtype(args.dtype, args.device)  # what the server ran ("auto" resolved the same way)
    print(f"\n`specdraft serve`, target {args.target} ({args.device}, {dtype}), "
          f"{'completions' if args.completions else 'chat'}, greedy, max_tokens {args.max_tokens}, "
          f"--max-batch-size {args.max_batch_size}, {'EOS ignored, ' if args.ignore_eos else ''}"
          f"{os.cpu_count()} CPUs, "
          f"median of {rounds} interleaved round(s) (every second round in reverse drafter order"
          + (f"; within a level, chunks of {args.wave} x concurrency requests to every server in turn" if getattr(args, "wave", 0) else "")
          + ")\n", file=file)
    print("| drafter | concurrency | requests | requests/s | tokens/s | tok/req | vs `none` | per round | τ "
          "| p50 latency (s) | p95 latency (s) | p50 TTFT (s) |", file=file)
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|", file=file)
    for drafter, c, r in rows:
        vs = f"{r['vs_none']:.2f}×" if r["vs_none"] is not None else "–"
        each = " ".join(f"{x:.2f}" for x in r["vs_none_rounds"]) if drafter != "none" else ""
        print(f"| {drafter} | {c} | {r['requests']} | {r['rps']:.2f} | {r['tps']:.1f} | {r['per_request']:.1f} | {vs} | {each} | {r['tau']:.2f} | "
              f"{r['p50']:.2f} | {r['p95']:.2f} | {r['ttft']:.3f} |", file=file)


if __name__ == "__main__":
    main()
