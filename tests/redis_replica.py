"""One router replica in its own process, for the multi-replica tests: ``python -m tests.redis_replica CONFIG``.

CONFIG is an :class:`indexer.Config` as JSON (backend ``redis``).  The
replica starts an :class:`indexer.Indexer` (ingesting from the engines the
config names, or none: a replica that only scores), then answers one JSON
command per stdin line with one JSON line on stdout:

- ``{"cmd": "sync", "seqs": {"pod": last_seq}}``: wait until the write path
  applied every named pod's batch ``last_seq`` (no-op without engines);
  answers ``{"ok": bool}``.
- ``{"cmd": "score", "prompts": [[token, ...], ...]}``: answers
  ``{"scores": [{"pod": chosen, "matched": {pod: blocks}}, ...]}``.
- ``{"cmd": "stats"}``: answers the index and write-path counters.
- ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import sys
import time

import msgspec

from kvindex.facade import Config, Indexer


def main(argv: list[str]) -> int:
    cfg = Config.from_json(argv[1])
    ix = Indexer(cfg)
    ix.start()
    ix.flush(30)
    out = sys.stdout
    out.write(msgspec.json.encode({"ready": True}).decode() + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            cmd = msgspec.json.decode(line)
            if cmd["cmd"] == "sync":
                ok = True
                deadline = time.monotonic() + 30
                want = cmd["seqs"]
                while cfg.kv_events_config.engines:
                    last = {p: s for p, _r, s in ix.pool.streams()}
                    if all(last.get(p) is not None and last[p] >= s for p, s in want.items()):
                        ok = ix.flush(30)
                        break
                    if time.monotonic() > deadline:
                        ok = False
                        break
                    time.sleep(0.01)
                reply: dict = {"ok": ok}
            elif cmd["cmd"] == "score":
                scores = []
                for tokens in cmd["prompts"]:
                    s = ix.score(tokens, cmd.get("pods"))
                    scores.append({"pod": s.pod, "matched": {p: v.matched_blocks for p, v in s.prefix.items()}})
                reply = {"scores": scores}
            elif cmd["cmd"] == "stats":
                reply = msgspec.to_builtins(ix.stats())
            else:
                break
            out.write(msgspec.json.encode(reply).decode() + "\n")
            out.flush()
    finally:
        ix.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
