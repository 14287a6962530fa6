"""Whether this tree's kernels compile to the same PTX as another tree's: the check behind
"an A/B flag's default build is the kept program" and "a refactor changes no code".

    python3 scripts/ptx_same.py HEAD~1                     # against a commit (git archive)
    python3 scripts/ptx_same.py ../other-checkout          # against a folder holding kernels/
    python3 scripts/ptx_same.py HEAD --extra-flags=-DKD_SOME_FLAG=0 --sources sm90/verify_wgmma_tma.cu

Each source of kernels/src is compiled to PTX for the virtual arch of every arch it is built
for (kdtree/build.py's rules: sm90/ for sm_90a alone), with the build's flags less line info,
in both trees; --extra-flags apply to this tree only. Anonymous-namespace and internal names
carry a per-file tag (it moves with the source's path and length), so they are replaced
before comparing.
Prints one line a source and arch; exits 1 where any differs, 2 on a compile error.

    python3 scripts/ptx_same.py HEAD --machine-code       # where the PTX differs, compare SASS

--machine-code assembles both sides' PTX with ptxas (beside nvcc) where it differs and
compares the cubins: the PTX can differ where the code the GPU runs does not (a register
count, two independent instructions in another order). The real arch of compute_90a is
sm_90a, of compute_120 sm_120; the PTX fallback (compute_90) is assembled for sm_90, one
of the GPUs that may JIT it. Exits 0 only where every pair matches in PTX or machine code.
"""
import argparse
import pathlib
import re
import struct
import subprocess
import sys
import tempfile

from kdtree import build

VIRTUAL = {"sm_90a": "compute_90a", "sm_120": "compute_120", "compute_90": "compute_90"}
REAL = {"sm_90a": "sm_90a", "sm_120": "sm_120", "compute_90": "sm_90"}  # what --machine-code assembles for
MINE = pathlib.Path(__file__).resolve().parent.parent / "kernels"  # this checkout's, not an installed copy's


def anonymous_names_replaced(ptx: str) -> str:
    """Each mangled per-file name (<length>_GLOBAL__N__... or <length>_INTERNAL_..., whose
    tags nvcc derives from the file) as one fixed token."""
    out, pos = [], 0
    for m in re.finditer(r"(\d+)(?:_GLOBAL__N__|_INTERNAL_)", ptx):
        if m.start() < pos:
            continue
        n = int(m.group(1))
        start = m.start(1) + len(m.group(1))
        out.append(ptx[pos:m.start()])
        out.append("ANON")
        pos = start + n
    out.append(ptx[pos:])
    return "".join(out)


def fail(message: str):
    print(f"ptx_same: {message}", file=sys.stderr)
    sys.exit(2)


def ptx_of(kernels: pathlib.Path, rel: str, arch: str, archs, extra_flags) -> str:
    flags = [f for f in build.compile_flags(archs, extra_flags) if f not in ("-lineinfo", "-Xcompiler", "-fPIC")]
    flags = [f"-I{kernels / 'include'}" if f.startswith("-I") else f for f in flags]
    cmd = [build.find_nvcc(), *flags, f"-gencode=arch={VIRTUAL[arch]},code={VIRTUAL[arch]}", "-ptx",
           str(kernels / "src" / rel), "-o", "-"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"{rel} ({arch}) did not compile in {kernels}:\n{r.stderr[-2000:]}")
    return anonymous_names_replaced(r.stdout)


def cubin_of(ptx: str, arch: str, tmp: pathlib.Path, side: str) -> bytes:
    """ptx assembled by ptxas (the one nvcc calls) for REAL[arch]; the names are the
    normalised ones, so two sides' cubins compare byte for byte."""
    ptxas = pathlib.Path(build.find_nvcc()).with_name("ptxas")
    src, out = tmp / f"{side}.ptx", tmp / f"{side}.cubin"
    src.write_text(ptx)
    r = subprocess.run([str(ptxas), f"-arch={REAL[arch]}", "-O3", str(src), "-o", str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"ptxas could not assemble the {side} PTX for {REAL[arch]}:\n{r.stderr[-2000:]}")
    return out.read_bytes()


def text_sections(cubin: bytes) -> dict:
    """A cubin's code, a function each: its ELF sections named .text.<mangled name>."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    out = {}
    for name, _, _, _, off, size in heads:
        label = cubin[names + name:cubin.index(b"\0", names + name)].decode()
        if label.startswith(".text."):
            out[label[len(".text."):]] = cubin[off:off + size]
    return out


def code_differences(ours: bytes, base: bytes) -> str:
    """Which functions' code differs, with their sizes in bytes (16 a Hopper or Blackwell
    instruction)."""
    a, b = text_sections(ours), text_sections(base)
    parts = []
    for fn in sorted(set(a) | set(b)):
        if a.get(fn) != b.get(fn):
            parts.append(f"{fn} ({len(b.get(fn, b''))} -> {len(a.get(fn, b''))} bytes)")
    return "; ".join(parts) or "only outside the functions' code"


def base_kernels(base: str, tmp: pathlib.Path) -> pathlib.Path:
    folder = pathlib.Path(base)
    if (folder / "kernels" / "src").is_dir():
        return folder / "kernels"
    archive = subprocess.run(["git", "archive", base, "kernels"], capture_output=True, cwd=MINE.parent)
    if archive.returncode != 0:
        fail(f"BASE must be a commit or a folder holding kernels/src, got {base!r}: "
             f"{archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    return tmp / "kernels"


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("base", help="a commit, or a folder holding kernels/src")
    a.add_argument("--archs", nargs="+", default=list(build.DEFAULT_ARCHS), choices=sorted(VIRTUAL),
                   help="the build's archs (default: the library's)")
    a.add_argument("--sources", nargs="+", help="sources under kernels/src (default: all)")
    a.add_argument("--extra-flags", default="", help="more nvcc flags for this tree, one string")
    a.add_argument("--machine-code", action="store_true",
                   help="where the PTX differs, assemble both with ptxas and compare the cubins")
    args = a.parse_args(argv)
    mine = MINE
    rels = args.sources or sorted(p.relative_to(mine / "src").as_posix() for p in (mine / "src").rglob("*.cu"))
    differ = ptx_only = 0
    with tempfile.TemporaryDirectory() as tmp:
        theirs = base_kernels(args.base, pathlib.Path(tmp))
        for rel in rels:
            if not (mine / "src" / rel).is_file():
                fail(f"--sources: no kernels/src/{rel} in this tree")
            if not (theirs / "src" / rel).is_file():
                print(f"{rel}: only in this tree")
                differ += 1
                continue
            for arch in build._source_archs(mine / "src" / rel, args.archs):
                ours = ptx_of(mine, rel, arch, args.archs, tuple(args.extra_flags.split()))
                base = ptx_of(theirs, rel, arch, args.archs, ())
                if ours == base:
                    print(f"{rel} ({VIRTUAL[arch]}): same")
                    continue
                if args.machine_code:
                    mc = cubin_of(ours, arch, pathlib.Path(tmp), "this")
                    mc_base = cubin_of(base, arch, pathlib.Path(tmp), "base")
                    same = mc == mc_base
                    print(f"{rel} ({VIRTUAL[arch]}): PTX differs, machine code for {REAL[arch]} "
                          f"{'the same' if same else 'differs: ' + code_differences(mc, mc_base)}")
                    ptx_only += same
                    differ += not same
                else:
                    print(f"{rel} ({VIRTUAL[arch]}): differs")
                    differ += 1
    if differ:
        print(f"{differ} differ")
    else:
        print("same PTX" if not ptx_only else f"same machine code ({ptx_only} differ in PTX alone)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
