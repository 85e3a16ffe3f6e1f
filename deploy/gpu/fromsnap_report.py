#!/usr/bin/env python3
"""The report of deploy/gpu/run-fromsnap.sh (issue 24): reads OUT/fromsnap-*/, OUT/limit.json and
OUT/rehome/ and prints a Markdown report whose last line is

    gpu-prefill: from_snapshot p50 X ms, reprefill p50 Y ms, limit p50 Z ms, over-limit Q, mismatches N

X: TTFT p50 (client side) of E4's large-append turns that P served by prefill from the snapshot
(its served log line says it loaded the prefix); Y: TTFT p50 of E3's large-append turns (P
re-prefilled the whole context); Z: the in-process limit (limit.json: the tail's prefill with the
prefix on the GPU plus one host->GPU copy of the prefix KV); Q = X / Z; N: recompute mismatches of
every request of every phase. With several prefix lengths the line gives each figure per prefix
("16384: ... / 32768: ..."), Q the largest. Exit status 0 only when every prefix has X, Y and Z,
N = 0 and every request was checked (KVC_REAL_VERIFY=1).

    fromsnap_report.py OUT [verify]          the report
    fromsnap_report.py --lengths OUT TAIL P1,P2,...
                                             "PREFIXES TAIL": the median loaded prefix of each fromsnap
                                             phase Pi and the largest median computed tail (for the
                                             limit phase); Pi and TAIL where nothing was loaded
Only the standard library: it runs on the GPU machine and here alike.
"""

import glob
import json
import math
import os
import re
import sys


def p50(xs):
    xs = sorted(xs)
    return xs[max(0, math.ceil(0.5 * len(xs)) - 1)] if xs else float("nan")


def pct(xs, q):
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def records(d):
    path = os.path.join(d, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def served(cluster_dir, role):
    """The served lines of the refworkers of a role in one arm's cluster directory."""
    out = []
    for path in sorted(glob.glob(os.path.join(cluster_dir, "sim-%s-*.log" % role))):
        for line in open(path, errors="replace"):
            if '"served"' not in line:
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            s = d.get("served")
            if d.get("message") == "served" and isinstance(s, dict):
                s["log"] = os.path.basename(path)
                out.append(s)
    return out


def cp_log_lines(cluster_dir, message):
    out = []
    for path in sorted(glob.glob(os.path.join(cluster_dir, "cp-*.log"))):
        for line in open(path, errors="replace"):
            if message not in line:
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if d.get("message") == message:
                out.append(d)
    return out


def fromsnap_dirs(out):
    ds = []
    for d in glob.glob(os.path.join(out, "fromsnap-*")):
        m = re.fullmatch(r"fromsnap-(\d+)", os.path.basename(d))
        if m and os.path.isdir(d):
            ds.append((int(m.group(1)), d))
    return sorted(ds)


def large_turns(d, arm):
    """arm's large-append turns (PD_FALLBACK, REAL_LARGE_APPEND) joined with P's served line
    (by session and input length: P's answer never reaches the client)."""
    ps = {(s.get("session_id"), s.get("input_tokens")): s for s in served(os.path.join(d, "cluster-" + arm), "prefill")}
    ds = {(s.get("session_id"), s.get("input_tokens")): s for s in served(os.path.join(d, "cluster-" + arm), "decode")}
    out = []
    for r in records(d):
        if r.get("arm") != arm or r.get("reason") != "ROUTE_REASON_REAL_LARGE_APPEND" and r.get("reason") != "REAL_LARGE_APPEND":
            continue
        r["p"] = ps.get((r.get("session_id"), r.get("input_tokens")))
        r["d"] = ds.get((r.get("session_id"), r.get("input_tokens")))
        out.append(r)
    return out


def lengths(out, tail, nominals):
    pre, tails = [], []
    dirs = dict(fromsnap_dirs(out))
    for nominal in nominals:
        d = dirs.get(nominal, os.path.join(out, "fromsnap-%d" % nominal))
        loaded = [r["p"]["loaded_tokens"] for r in large_turns(d, "E4") if r["p"] and r["p"].get("loaded_tokens")]
        comp = [r["input_tokens"] - r["p"]["loaded_tokens"] for r in large_turns(d, "E4")
                if r["p"] and r["p"].get("loaded_tokens")]
        pre.append(str(p50(loaded)) if loaded else str(nominal))
        tails.append(p50(comp) if comp else int(tail))
    # limit.py takes one tail: the largest of the phases' medians (the conservative limit)
    return ",".join(pre), max(tails) if tails else int(tail)


def fmt(x, nd=1):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else ("%.*f" % (nd, x))


def main(argv):
    if len(argv) >= 4 and argv[0] == "--lengths":
        nominals = [int(x) for x in argv[3].split(",") if x.strip()]
        if not nominals:
            print("--lengths: no prefix lengths", file=sys.stderr)
            return 2
        p, t = lengths(argv[1], argv[2], nominals)
        print(p, t)
        return 0
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    out = argv[0]
    verify = (argv[1] if len(argv) > 1 else "1") == "1"
    limits = {}
    lp = os.path.join(out, "limit.json")
    if os.path.exists(lp):
        for r in json.load(open(lp)):
            limits[r["prefix"]] = r
    every = []  # every request of every phase (mismatches)
    lines = ["# Prefill from the snapshot and re-homing on a GPU, real attention KV (issue 24)", ""]
    lines.append("Made by deploy/gpu/run-fromsnap.sh and deploy/gpu/fromsnap_report.py from %s." % out)
    if limits:
        l0 = next(iter(limits.values()))
        lines.append("Model %s on %s, %d KV bytes per token." % (l0["model"], l0["device"], l0["kv_bytes_per_token"]))
    lines += ["", "## Prefill from the snapshot against re-prefill", "",
              "TTFT is the client's (kvc-bench, through the gateway; P computes, D receives only the tail's "
              "pages, D's first token); P's figures are from its served log line (load + prefill + scatter).", "",
              "| prefix (nominal) | arm | how P served it | turns | ok | TTFT p50 ms | TTFT max ms | P loaded tokens p50 | "
              "P load ms p50 | P prefill ms p50 (load included) | P tokens computed p50 | sent MB p50 |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    per = []  # (nominal, X, Y, Z, Q)
    phases = []  # the per-phase breakdown's rows
    for nominal, d in fromsnap_dirs(out):
        every += records(d)
        xs, ys = [], []
        for arm in ("E4", "E3"):
            rs = large_turns(d, arm)
            groups = {}
            for r in rs:
                p = r["p"] or {}
                how = ("no P log line" if not r["p"] else "from snapshot" if p.get("loaded_tokens") else
                       "load missed: whole context" if p.get("load_miss") else "whole context")
                groups.setdefault(how, []).append(r)
            for how, g in sorted(groups.items()):
                ok = [r for r in g if r.get("ok")]
                t = [r["ttft_s"] * 1000 for r in ok]
                ps = [r["p"] for r in ok if r["p"]]
                lines.append("| %d | %s | %s | %d | %d | %s | %s | %s | %s | %s | %s | %s |" % (
                    nominal, arm, how, len(g), len(ok), fmt(p50(t)), fmt(max(t) if t else None),
                    fmt(p50([p.get("loaded_tokens", 0) for p in ps]), 0), fmt(p50([p.get("load_ms", 0) for p in ps])),
                    fmt(p50([p.get("prefill_ms", 0) for p in ps])), fmt(p50([p.get("prefill_tokens", 0) for p in ps]), 0),
                    fmt(p50([p.get("sent_bytes", 0) / 1e6 for p in ps]))))
                dd = [r["d"] for r in ok if r.get("d")]
                srcs = {}
                for x in dd:
                    srcs[x.get("first_token_source", "?")] = srcs.get(x.get("first_token_source", "?"), 0) + 1
                phases.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                    nominal, arm, how, fmt(p50([p.get("load_ms", 0) for p in ps])),
                    fmt(p50([p.get("gather_ms", float("nan")) for p in ps])),
                    fmt(p50([p.get("forward_ms", float("nan")) for p in ps])),
                    fmt(p50([p.get("scatter_ms", float("nan")) for p in ps])),
                    fmt(p50([p.get("send_ms", p.get("transfer_ms", float("nan"))) for p in ps])),
                    fmt(p50([x.get("receive_wait_ms", float("nan")) for x in dd])),
                    fmt(p50([x.get("first_step_ms", float("nan")) for x in dd])),
                    ", ".join("%s %d" % kv for kv in sorted(srcs.items())) or "-"))
                if arm == "E4" and how == "from snapshot":
                    xs = t
                if arm == "E3" and how == "whole context":
                    ys = t
        x, y = p50(xs), p50(ys)
        lim = None
        for pre, r in limits.items():  # the limit at this phase's loaded prefix (nearest)
            if abs(pre - nominal) <= max(1024, nominal // 8):
                lim = r
        z = lim["limit_ms"] if lim else float("nan")
        q = x / z if xs and lim else float("nan")
        per.append((nominal, x, y, z, q, lim))
    lines += ["", "Per phase, p50 over the ok turns (P's and D's served lines; each P phase ends with the device "
              "idle): P load from the store, gather of the loaded prefix into the cache, the tail's forward "
              "(last position's logits only), scatter of the tail's KV into the pool, send to D; D's wait for "
              "the transfer and its first step (receive end to the first token: ~0 when P's token came in "
              "the aux row).", "",
              "| prefix (nominal) | arm | how P served it | P load ms | P gather ms | P forward ms | P scatter ms | "
              "P send ms | D receive wait ms | D first step ms | D first token from |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"] + phases
    lines += ["", "## The limit, in-process on the same GPU (python -m kvc_refworker.limit)", "",
              "| prefix | tail | tail prefill with prefix on GPU ms (gather / forward / scatter) | "
              "host->GPU copy of prefix KV ms | GB/s | limit Z ms | whole-context prefill ms |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for pre, r in sorted(limits.items()):
        split = " / ".join(fmt(r.get("tail_%s_ms" % k)) for k in ("gather", "forward", "scatter"))
        lines.append("| %d | %d | %s (%s) | %s | %s | %s | %s |" % (
            pre, r["tail"], fmt(r["tail_prefill_ms"]), split, fmt(r["h2d_ms"]), fmt(r["h2d_gbps"]),
            fmt(r["limit_ms"]), fmt(r["reprefill_ms"])))

    rh = os.path.join(out, "rehome")
    rehome_ok = True
    if os.path.isdir(rh):
        rs = records(rh)
        every += rs
        lines += ["", "## Re-homing a killed decode worker's sessions", "",
                  "decode-0's engine is SIGKILLed after every session's first turn (its sidecar lives and reports "
                  "it down). Time to resident: the control plane's `session re-homed` log line (from the worker "
                  "leaving READY until the new decode worker committed the whole snapshot). Next turn: the first "
                  "turn of each moved session after the kill.", "",
                  "| arm | sessions moved | re-homed | time to resident p50 ms | max ms | next turn modes | "
                  "next turn TTFT p50 ms | max ms | failed |", "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
        for arm in ("E4", "E3"):
            ar = [r for r in rs if r.get("arm") == arm]
            first = {r["session_id"]: r for r in ar if r.get("turn") == 0}
            moved = sorted(s for s, r in first.items() if r.get("decode_worker") == "decode-0")
            nxt = [r for r in ar if r.get("turn") == 1 and r["session_id"] in moved]
            cp = cp_log_lines(os.path.join(rh, "cluster-" + arm), "session re-homed")
            ttr = [float(d.get("time_to_resident", "nan")) for d in cp if d.get("session") in moved]
            ok = [r for r in nxt if r.get("ok")]
            t = [r["ttft_s"] * 1000 for r in ok]
            modes = ", ".join("%s %d" % (m, sum(1 for r in nxt if r.get("execution_mode") == m))
                              for m in sorted({r.get("execution_mode", "") for r in nxt}))
            lines.append("| %s | %d | %d | %s | %s | %s | %s | %s | %d |" % (
                arm, len(moved), len(ttr), fmt(p50(ttr)), fmt(max(ttr) if ttr else None), modes or "-",
                fmt(p50(t)), fmt(max(t) if t else None), len(nxt) - len(ok)))
            if arm == "E4" and (not moved or len(ttr) < len(moved)):
                rehome_ok = False
        # Per killed session: when the leader re-homed it, how long until resident, and its next
        # turn's TTFT with re-homing (E4) against a re-prefill (E3).
        lines += ["", "| session | E4 re-homed at unix_ms | E4 time to resident ms | E4 next turn mode | "
                  "E4 next TTFT ms | E3 next turn mode | E3 next TTFT ms |", "|---|---:|---:|---|---:|---|---:|"]
        by = {}
        for arm in ("E4", "E3"):
            ar = [r for r in rs if r.get("arm") == arm]
            killed = {r["session_id"] for r in ar if r.get("turn") == 0 and r.get("decode_worker") == "decode-0"}
            for r in ar:
                if r.get("turn") == 1 and r["session_id"] in killed:
                    by.setdefault(r["session_id"], {})[arm] = r
            if arm == "E4":
                for dl in cp_log_lines(os.path.join(rh, "cluster-E4"), "session re-homed"):
                    if dl.get("session") in killed:
                        by.setdefault(dl["session"], {})["cp"] = dl
        for sid in sorted(by):
            e4, e3, dl = by[sid].get("E4") or {}, by[sid].get("E3") or {}, by[sid].get("cp") or {}
            lines.append("| %s | %s | %s | %s | %s | %s | %s |" % (
                sid, dl.get("unix_ms", "-"), fmt(float(dl["time_to_resident"])) if "time_to_resident" in dl else "-",
                e4.get("execution_mode", "-"), fmt(e4["ttft_s"] * 1000) if e4.get("ok") else "-",
                e3.get("execution_mode", "-"), fmt(e3["ttft_s"] * 1000) if e3.get("ok") else "-"))

    mism = sum(r.get("recompute_mismatches", 0) for r in every)
    unchecked = sum(1 for r in every if r.get("ok") and not r.get("recompute_checked"))
    failed = sum(1 for r in every if not r.get("ok"))
    lines += ["", "requests %d, failed %d, ok but unchecked %d, recompute mismatches %d" % (len(every), failed, unchecked, mism)]

    def each(i, nd=1):
        return " / ".join("%d: %s" % (p[0], fmt(p[i], nd)) for p in per) if per else "n/a"

    qmax = max((p[4] for p in per), default=float("nan"))
    n = str(mism) if verify else "n/a (KVC_REAL_VERIFY=0)"
    if len(per) == 1:
        line = "gpu-prefill: from_snapshot p50 %s ms, reprefill p50 %s ms, limit p50 %s ms, over-limit %s, mismatches %s" % (
            fmt(per[0][1]), fmt(per[0][2]), fmt(per[0][3]), fmt(per[0][4], 3), n)
    else:
        line = "gpu-prefill: from_snapshot p50 %s ms, reprefill p50 %s ms, limit p50 %s ms, over-limit %s (max %s), mismatches %s" % (
            each(1), each(2), each(3), each(4, 3), fmt(qmax, 3), n)
    lines += ["", line]
    print("\n".join(lines))
    good = per and all(not math.isnan(p[1]) and not math.isnan(p[2]) and not math.isnan(p[3]) for p in per)
    return 0 if good and verify and mism == 0 and unchecked == 0 and rehome_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
