import re, sys
def load(p):
    out = {}
    for line in open(p):
        parts = line.split(None, 2)
        if len(parts) < 3: continue
        out[parts[0]] = (int(parts[1]), parts[2].strip())
    return out
b, a = load('/tmp/cpushare/before.txt'), load('/tmp/cpushare/after.txt')
def label(args):
    for pat, name in [(r'Engine', 'Engine replica (model)'), (r'Ingress', 'Ingress replica'), (r'ProxyActor', 'Serve proxy'),
                      (r'ServeController', 'Serve controller'), (r'raylet', 'raylet'), (r'gcs_server', 'GCS'),
                      (r'dashboard', 'dashboard'), (r'serve run', 'serve run CLI'), (r'log_monitor', 'log monitor'),
                      (r'monitor\.py', 'autoscaler monitor'), (r'runtime_env', 'runtime env agent')]:
        if re.search(pat, args): return name
    return 'other: ' + args[:60]
rows = {}
for pid, (t, args) in a.items():
    d = t - b.get(pid, (0, ''))[0]
    if d > 0:
        rows.setdefault(label(args), 0)
        rows[label(args)] += d
s0 = list(map(int, open('/tmp/cpushare/stat-before.txt').read().split()[1:]))
s1 = list(map(int, open('/tmp/cpushare/stat-after.txt').read().split()[1:]))
delta = [y - x for x, y in zip(s0, s1)]
hz = 100
total = sum(delta) / hz; idle = (delta[3] + delta[4]) / hz
print(f"window CPU capacity {total:.0f} s, idle {idle:.0f} s ({idle/total:.0%})")
for k, v in sorted(rows.items(), key=lambda kv: -kv[1]):
    print(f"{k:40s} {v:5d} s  {v/total:6.1%}")
