"""What ptxas says of moekit's own wgmma main loops, checked without a GPU: each .cu file that
instantiates one (it includes block_gemm_sm90.cuh) is compiled again
with the build's own command (compile_commands.json) and `-Xptxas -v`. A "(C75xx) Potential
Performance Loss" line fails the check: ptxas then serializes wgmma instructions (C7511: not enough
registers for the wgmma pipeline; C7514: a wgmma in flight across a branch), which compiles, passes
every test and runs the GEMM up to 2x slower. Registers and spill bytes of each kernel are printed.
A change that put a second wgmma shape in the block GEMM hit C7511 (docs/PERF.md, "Ragged experts'
last token tile").

  python3 scripts/check_ptxas.py build/compile_commands.json   # exit 1 and the messages on a C75xx
  python3 scripts/check_ptxas.py --self-test                    # the check itself, on ptxas output
"""
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

MAIN_LOOPS = ("block_gemm_sm90.cuh",)
LOSS = re.compile(r"\(C75\d\d\)[^\n]*")
KERNEL = re.compile(r"Compiling entry function '(\w+)'")
USAGE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads|Used (\d+) registers")


def findings(ptxas_output):
    """The C75xx performance-loss messages, and a line of registers and spills a kernel."""
    losses = [m.group(0).strip() for m in LOSS.finditer(ptxas_output)]
    usage, kernel, spills = [], None, None
    for line in ptxas_output.splitlines():
        k = KERNEL.search(line)
        if k:
            kernel, spills = k.group(1), None
            continue
        for m in USAGE.finditer(line):
            if m.group(1) is not None:
                spills = (int(m.group(1)), int(m.group(2)))
            elif kernel is not None:
                usage.append((kernel, int(m.group(3)), spills))
                kernel = None
    return losses, usage


def instantiates_a_main_loop(path):
    text = pathlib.Path(path).read_text(errors="replace")
    return any(f'#include "cuda/{h}"' in text for h in MAIN_LOOPS)


def check(compile_commands):
    entries = json.loads(pathlib.Path(compile_commands).read_text())
    files = [e for e in entries if e["file"].endswith(".cu") and instantiates_a_main_loop(e["file"])]
    if not files:
        print(f"check_ptxas: no .cu file in {compile_commands} instantiates {' or '.join(MAIN_LOOPS)}")
        return 1
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for e in files:
            args = shlex.split(e["command"])
            out = args.index("-o")
            args[out + 1] = str(pathlib.Path(tmp) / "x.o")
            args[1:1] = ["-Xptxas", "-v"]
            r = subprocess.run(args, cwd=e["directory"], capture_output=True, text=True)
            name = pathlib.Path(e["file"]).name
            if r.returncode != 0:
                print(f"check_ptxas: {name}: the compile failed:\n{r.stderr[-2000:]}")
                failed = 1
                continue
            losses, usage = findings(r.stdout + r.stderr)
            for kernel, regs, spills in usage:
                s = f", spills {spills[0]} / {spills[1]} bytes stored / loaded" if spills else ""
                print(f"  {name}: {kernel[:90]}: {regs} registers{s}")
            for loss in losses:
                print(f"check_ptxas: {name}: {loss}")
                failed = 1
    print("check_ptxas: " + ("wgmma serialized (see above)" if failed else f"{len(files)} files, no C75xx"))
    return failed


def self_test():
    clean = """ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelv
    24 bytes stack frame, 20 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 24 bytes cumulative stack size
"""
    serialized = clean + (
        "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized "
        "due to insufficient register resources for the wgmma pipeline in the function '_Z6kernelv'\n")
    losses, usage = findings(clean)
    assert losses == [] and usage == [("_Z6kernelv", 168, (20, 44))], (losses, usage)
    losses, _ = findings(serialized)
    assert len(losses) == 1 and losses[0].startswith("(C7511) Potential Performance Loss"), losses
    assert instantiates_a_main_loop(__file__) is False
    print("check_ptxas self-test: clean output passes, a C7511 line is caught")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(check(sys.argv[1]))
