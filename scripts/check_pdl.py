"""The rule that keeps programmatic dependent launch correct (src/cuda/pdl.cuh), checked in the
sources: in every file that launches a kernel with launch_pdl, every __global__ function's first
statement is pdl_enter() or pdl_wait(), so no kernel of such a file touches global memory before
the kernels it depends on are complete. (A kernel of such a file launched plainly pays nothing for
it: the wait returns at once.) A break of the rule shows only as a rare race on the GPU; here it is
an error with the kernel's name.

  python3 scripts/check_pdl.py src/cuda     # exit 1 and a list of the kernels that break it
  python3 scripts/check_pdl.py --self-test  # the check itself, on snippets that keep and break it
"""
import pathlib
import re
import sys

FIRST = re.compile(r"\s*(pdl_enter|pdl_wait)\s*\(\s*\)\s*;")


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: " " * len(m.group(0)), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def kernels_breaking_the_rule(text):
    """The names of the __global__ functions whose body does not start with the wait."""
    code = strip_comments(text)
    if "launch_pdl(" not in code:
        return []
    bad = []
    for m in re.finditer(r"__global__\b", code):
        # The parameter list: the first '(' after the name that is not __launch_bounds__'s.
        i = m.end()
        name = None
        while True:
            p = code.index("(", i)
            word = re.search(r"(\w+)\s*(<[^()]*>)?\s*$", code[i:p])
            if word and word.group(1) != "__launch_bounds__":
                name = word.group(1)
                break
            depth, i = 0, p
            while True:  # skip __launch_bounds__(...)
                depth += {"(": 1, ")": -1}.get(code[i], 0)
                i += 1
                if depth == 0:
                    break
        depth, j = 0, p
        while True:
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            j += 1
            if depth == 0:
                break
        brace = code.index("{", j)
        if ";" in code[j:brace]:
            continue  # a declaration, not a definition
        if not FIRST.match(code, brace + 1):
            bad.append(name)
    return bad


def self_test():
    good = """
      #include "cuda/pdl.cuh"
      __global__ void __launch_bounds__(256) a(int* x) {
        pdl_enter();  // first
        x[0] = 1;
      }
      template <int N>
      __global__ void b(const float* __restrict__ y) { pdl_wait(); }
      void go() { launch_pdl(a, 1, 1, 0, s, p); }
    """
    bad = """
      __global__ void __launch_bounds__(kThreads) c(int* x) {
        x[0] = 1;
        pdl_enter();
      }
      __global__ void d(int* x) { /* pdl_enter(); */ x[0] = 2; }
      void go() { launch_pdl(c, 1, 1, 0, s, p); }
    """
    plain = "__global__ void e(int* x) { x[0] = 1; }\nvoid go() { e<<<1, 1>>>(p); }"
    assert kernels_breaking_the_rule(good) == [], kernels_breaking_the_rule(good)
    assert kernels_breaking_the_rule(bad) == ["c", "d"], kernels_breaking_the_rule(bad)
    assert kernels_breaking_the_rule(plain) == []
    print("check_pdl: self-test passed")


def main(args):
    if args == ["--self-test"]:
        self_test()
        return 0
    if len(args) != 1:
        print(__doc__)
        return 2
    files = sorted(p for p in pathlib.Path(args[0]).rglob("*") if p.suffix in (".cu", ".cuh"))
    failures = []
    checked = 0
    for f in files:
        text = f.read_text()
        if "launch_pdl(" in strip_comments(text):
            checked += 1
        failures += [f"{f}: kernel {k}" for k in kernels_breaking_the_rule(text)]
    if failures:
        print("check_pdl: these kernels live in a file that launches with launch_pdl and do not start with")
        print("pdl_enter() or pdl_wait() (src/cuda/pdl.cuh: the wait must come before any global memory access):")
        print("\n".join("  " + x for x in failures))
        return 1
    print(f"check_pdl: {checked} files launch with launch_pdl; every kernel in them waits first")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
