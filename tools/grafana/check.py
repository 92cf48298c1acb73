#!/usr/bin/env python3
"""Check the Grafana dashboard against real metrics.

  tools/grafana/check.py DASHBOARD RULES_OUT SCRAPE.prom...

Writes every panel expression as a recording rule to RULES_OUT (for
`promtool check rules`, which parses the PromQL), then checks that every
lbagent_* metric an expression names is a family in the scraped samples
(SCRAPE.prom: the three /metrics endpoints of a live system). Exit 1 with
one line per unknown name.
"""
import json, re, sys

dash_path, rules_out, *scrapes = sys.argv[1:]
dash = json.load(open(dash_path))
exprs = []
def walk(panels):
    for p in panels:
        walk(p.get("panels", []))
        for t in p.get("targets", []):
            exprs.append((p["title"], t["expr"]))
walk(dash["panels"])
with open(rules_out, "w") as f:
    f.write("groups:\n  - name: lbagent-dashboard\n    rules:\n")
    for i, (_, e) in enumerate(exprs):
        f.write(f"      - record: lbagent_dashboard:panel{i}\n        expr: {json.dumps(e)}\n")
known = set()
for path in scrapes:
    for line in open(path):
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            known.add(m.group(1))
        elif line and not line.startswith("#"):
            known.add(re.split(r"[{ ]", line, 1)[0])
def family(name):
    if name in known:
        return True
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base in known
bad = [(t, n) for t, e in exprs for n in sorted(set(re.findall(r"\blbagent_[a-z0-9_]+", e))) if not family(n)]
for t, n in bad:
    print(f"dashboard panel {t!r}: no metric {n} on any endpoint", file=sys.stderr)
if bad:
    sys.exit(1)
print(f"dashboard: {len(exprs)} expressions, every metric name found on the endpoints")
