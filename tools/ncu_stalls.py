"""Summarizes ncu's per-SASS-instruction source page (--page source --print-source sass --csv): the
instructions where warps were sampled most, with their share of all samples, and the samples by
opcode. Used by tools/gpu-experiments.sh profile."""
import csv
import sys
from collections import Counter


def main(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = next((i for i, r in enumerate(rows) if any("Source" == c.strip() or "Address" in c for c in r)), None)
    if head is None:
        print(f"ncu_stalls: no source table in {path}")
        return
    cols = rows[head]
    print("columns:", "; ".join(c for c in cols if c))
    src = next(i for i, c in enumerate(cols) if c.strip() == "Source")
    sample_cols = [i for i, c in enumerate(cols) if "Sampling" in c]
    if not sample_cols:
        print("ncu_stalls: no sampling columns")
        return
    total_col = sample_cols[0]

    def num(s):
        try:
            return float(s.replace(",", ""))
        except ValueError:
            return 0.0

    body = [r for r in rows[head + 1:] if len(r) > max(src, total_col)]
    total = sum(num(r[total_col]) for r in body) or 1.0
    print(f"{cols[total_col]}: {total:.0f} samples over {len(body)} instructions")
    by_op = Counter()
    for r in body:
        op = r[src].strip().split(" ")
        op = next((t for t in op if t and not t.startswith("@")), "?").split(".")[0]
        by_op[op] += num(r[total_col])
    print("by opcode:", ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(12)))
    for r in sorted(body, key=lambda r: -num(r[total_col]))[:25]:
        extra = " ".join(f"{cols[i].split('(')[-1].rstrip(')')}={r[i]}" for i in sample_cols[1:] if num(r[i]) > 0)
        print(f"{100 * num(r[total_col]) / total:5.1f}%  {r[src].strip()[:80]:<80} {extra}")


if __name__ == "__main__":
    main(sys.argv[1])
