#!/usr/bin/env python3
"""Compare llama.cpp's intermediate tensors with ferrum's FERRUM_TRACE output, layer by layer.

Usage: compare_trace.py LLAMA_TRACE FERRUM_TRACE [--tol 1e-5] [--all]

LLAMA_TRACE is either
  * the stdout of `llama-eval-callback` (tensor header lines `common_debug_cb_eval: NAME = (f32) OP(...) = {ne0, ne1,
    ne2, ne3}`, then the nested value lists (3 leading and 3 trailing values per row, %.4f) and `sum = S`, an f32
    running sum printed with %f), or
  * lines `llama-trace NAME op=.. type=.. ne=[a,b,c,d] sum=S first=[..] last_row=[..]` (full precision, double sum),
    as printed by a small local dumper built against libllama (see scripts/llamacpp/README.md).
FERRUM_TRACE: stderr of `FERRUM_TRACE=1 ferrum generate ...`, lines
  `ferrum-trace NAME rows=R cols=C sum=S first=[..] last_row=[..]`.

llama.cpp names a tensor again after each reshape/RoPE (e.g. three `Qcur-0`), so the LAST tensor of a name is
the one compared. Tensors whose row count differs (llama.cpp keeps only the output row in the last layer after
`inp_out_ids`) are compared on the last row's leading values only.
Prints: name | llama.cpp sum | ferrum sum | relative diff of sums | max abs diff of leading values, and names the
first tensor whose difference exceeds --tol (relative, sums) or the printing precision (values). With the
full-precision input, a flagged tensor differs beyond what 6-decimal printing explains; bit-exactness still has
to be checked on raw values (the dumper can write them).
"""
import argparse
import re
import sys

HDR = re.compile(r"common_debug_cb_eval:\s+(\S+) = \((\w+)\)\s+(.*) = \{([-\d, ]+)\}\s*$")
NUM = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)", re.I)


def parse_list(s):
    s = s.strip()
    return [float(v) for v in s.split(",") if v.strip()] if s else []


def parse_llama(path):
    """name -> list of records (in order): dict(ne, rows, sum, first, last_row, prec)."""
    out = {}
    order = []
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("llama-trace "):
            m = re.match(r"llama-trace (\S+) op=(.*?) type=(\S+) ne=\[([-\d,]+)\] sum=(\S+) first=\[(.*?)\] "
                         r"last_row=\[(.*?)\]", line)
            if m:
                ne = [int(v) for v in m.group(4).split(",")]
                rec = dict(op=m.group(2), ne=ne, sum=float(m.group(5)), first=parse_list(m.group(6)),
                           last_row=parse_list(m.group(7)), prec=0.0)
                out.setdefault(m.group(1), []).append(rec)
                order.append(m.group(1))
            i += 1
            continue
        m = HDR.search(line)
        if not m:
            i += 1
            continue
        name, op = m.group(1), m.group(3)
        ne = [int(v) for v in m.group(4).split(",")]
        # value rows: lines that start with '[' after stripping and hold numbers; stop at "sum ="
        rows = []
        s = None
        j = i + 1
        while j < len(lines):
            t = lines[j].strip()
            if t.startswith("sum ="):
                s = float(t.split("=", 1)[1])
                break
            if HDR.search(lines[j]) or lines[j].startswith("llama-trace "):
                break
            if t.startswith("[") and NUM.search(t):
                vals = [float(v) for v in NUM.findall(t.replace("...", " "))]
                rows.append(vals)
            j += 1
        if s is not None:
            # leading values: the first printed row's first 3; last row: first row of the last outer block
            first = rows[0][:3] if rows else []
            outer_blocks = ne[2] if ne[2] > 1 else 1
            if outer_blocks > 1:
                per_block = len(rows) // min(outer_blocks, 6) if rows else 0
                last = rows[-per_block][:3] if per_block else []
            else:
                last = rows[-1][:3] if rows else []
            rec = dict(op=op, ne=ne, sum=s, first=first, last_row=last, prec=5e-5)
            out.setdefault(name, []).append(rec)
            order.append(name)
            i = j + 1
        else:
            i = j
    return out, order


def parse_ferrum(path):
    out = {}
    order = []
    pat = re.compile(r"ferrum-trace (\S+) rows=(\d+) cols=(\d+) sum=(\S+) first=\[(.*?)\](?: last_row=\[(.*?)\])?")
    with open(path, errors="replace") as f:
        for line in f:
            m = pat.search(line)
            if not m:
                continue
            name = m.group(1)
            out[name] = dict(rows=int(m.group(2)), cols=int(m.group(3)), sum=float(m.group(4)),
                             first=parse_list(m.group(5)), last_row=parse_list(m.group(6) or ""))
            order.append(name)
    return out, order


# ferrum name -> llama.cpp callback name, where they differ (Gemma 3: the residual after attention is `sa_out`)
ALIASES = {"ffn_inp": "sa_out"}


def pow2_rescale(name, r, f):
    """Gemma 3's llama.cpp graph names Q `Qcur` before multiplying it by 1/sqrt(head_dim) (a power of two, exact);
    ferrum traces Q after that scale. Rescale llama.cpp's record by the power of two the first values imply."""
    import math
    if not name.startswith("Qcur") or not r["first"] or not f["first"] or r["first"][0] == 0 or f["first"][0] == 0:
        return r
    k = round(math.log2(abs(f["first"][0] / r["first"][0])))
    if k == 0 or abs(f["first"][0] / r["first"][0] / 2.0 ** k - 1) > 1e-3:
        return r
    s = 2.0 ** k
    return dict(r, sum=r["sum"] * s, first=[v * s for v in r["first"]], last_row=[v * s for v in r["last_row"]],
                prec=r["prec"] * s, scaled=s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("llama")
    ap.add_argument("ferrum")
    ap.add_argument("--tol", type=float, default=1e-6,
                    help="relative tolerance on sums (default 1e-6; an absolute floor of 2e-6 covers ferrum's 6 printed "
                         "decimals; raised to 1e-4 for llama-eval-callback's f32 running sums)")
    ap.add_argument("--all", action="store_true", help="also list llama.cpp tensors ferrum does not trace")
    a = ap.parse_args()
    ll, lorder = parse_llama(a.llama)
    fe, forder = parse_ferrum(a.ferrum)
    if not ll:
        sys.exit(f"no llama.cpp tensors found in {a.llama}")
    if not fe:
        sys.exit(f"no ferrum-trace lines found in {a.ferrum}")
    print(f"{'name':<18} {'llama.cpp sum':>16} {'ferrum sum':>16} {'rel diff':>10} {'max|dv|':>10}  note")
    first_bad = None
    for name in forder:
        f = fe[name]
        recs = ll.get(name)
        note = ""
        if not recs and name.split("-")[0] in ALIASES:
            alias = ALIASES[name.split("-")[0]] + name[len(name.split("-")[0]):]
            recs = ll.get(alias)
            note = f"llama.cpp name {alias}"
        if not recs:
            print(f"{name:<18} {'-':>16} {f['sum']:>16.6f} {'-':>10} {'-':>10}  not in llama.cpp output")
            continue
        r = recs[-1]
        lrows = 1
        for d in r["ne"][1:]:
            lrows *= d
        lcols = r["ne"][0]
        r = pow2_rescale(name, r, f)
        if r.get("scaled"):
            note = (note + f" llama.cpp values x{r['scaled']:g} (ferrum traces Q after the exact query scale)").strip()
        same_shape = lrows * lcols == f["rows"] * f["cols"]
        if same_shape:
            rel = abs(r["sum"] - f["sum"]) / max(abs(r["sum"]), abs(f["sum"]), 1e-30)
            pairs = list(zip(r["first"], f["first"])) + list(zip(r["last_row"], f["last_row"]))
        else:
            rel = float("nan")
            note = f"llama.cpp has {lrows}x{lcols}, ferrum {f['rows']}x{f['cols']}: last row only"
            # llama.cpp kept only the last row: its first values are ferrum's last row
            pairs = list(zip(r["first"], f["last_row"]))
        dv = max((abs(x - y) for x, y in pairs), default=float("nan"))
        # ferrum prints 6 decimals; llama-eval-callback 4 decimals and an f32 running sum
        vtol = max(r["prec"], 5e-7) + 1e-5 * max((abs(x) for x, _ in pairs), default=0.0)
        stol = a.tol if r["prec"] == 0.0 else max(a.tol, 1e-4)
        sum_bad = same_shape and abs(r["sum"] - f["sum"]) > max(stol * max(abs(r["sum"]), abs(f["sum"])), 2e-6)
        bad = sum_bad or dv > vtol
        if bad and first_bad is None:
            first_bad = name
            note = ("FIRST DIVERGENCE " + note).strip()
        print(f"{name:<18} {r['sum']:>16.6f} {f['sum']:>16.6f} {rel:>10.2e} {dv:>10.2e}  {note}")
    if a.all:
        missing = [n for n in dict.fromkeys(lorder) if n not in fe]
        print("\nllama.cpp tensors not traced by ferrum:", ", ".join(missing))
    print(f"\nfirst divergent tensor: {first_bad or 'none'}")


if __name__ == "__main__":
    main()
