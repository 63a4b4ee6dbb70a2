#!/usr/bin/env python3
"""Compares the SASS of CUDA sources in the working tree with a git revision's, per kernel and per arch.

    scripts/compare-sass.py [--build DIR] [--arch 90a,100] [--jobs N] BASE [FILE.cu ...]

A refactor of a kernel (naming its steps, moving code between headers) claims "no behaviour change"; identical SASS
and resource usage for every kernel on every arch proves it without a GPU. Each FILE (default: the .cu files of the
build that differ from BASE or include, through quoted includes, a header that does) is compiled twice per arch,
from BASE (`git archive`) and from the working tree, with the build's own nvcc command (DIR/compile_commands.json:
configure DIR with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON) narrowed to that one arch. The cubins' `cuobjdump -sass`
and `-res-usage` are compared function by function. BASE's dumps are kept under DIR/sass/ and reused; the working
tree's and a unified diff per differing function are written there too. Exit status 1 when anything differs.

cuobjdump: $CUOBJDUMP, else on PATH, else beside nvcc (pip's nvidia-cuda-cuobjdump and triton wheels ship one).
"""
import argparse
import concurrent.futures
import difflib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ARCHS = ["80", "86", "89", "90a", "100", "120"]


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout


def compile_commands(build):
    path = os.path.join(build, "compile_commands.json")
    if not os.path.exists(path):
        sys.exit(f"compare-sass: {path} is missing: configure {build} with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON")
    return {os.path.relpath(e["file"], ROOT): e for e in json.load(open(path)) if e["file"].endswith(".cu")}


def one_arch_command(entry, arch):
    """The build's command for the entry's file, with the options file inlined, one arch, and the source tree
    as {tree} and the output as {out} (filled in per tree)."""
    words = shlex.split(entry["command"])
    out, i = [], 0
    while i < len(words):
        w = words[i]
        if w == "--options-file":
            out += shlex.split(open(os.path.join(entry["directory"], words[i + 1])).read())
            i += 2
            continue
        if w == "-o":
            out += ["-o", "{out}"]
            i += 2
            continue
        if not w.startswith("--generate-code="):
            out.append(w)
        i += 1
    out.insert(1, f"--generate-code=arch=compute_{arch},code=[sm_{arch}]")
    return [w.replace(ROOT, "{tree}") for w in out]


def quoted_includes(tree, path, seen):
    """`path` and every file it includes with #include "...", resolved against its folder, src/ and include/."""
    if path in seen or not os.path.exists(os.path.join(tree, path)):
        return seen
    seen.add(path)
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', open(os.path.join(tree, path)).read(), re.M):
        for base in (os.path.dirname(path), "src", "include"):
            candidate = os.path.normpath(os.path.join(base, name))
            if os.path.exists(os.path.join(tree, candidate)):
                quoted_includes(tree, candidate, seen)
                break
    return seen


def cuobjdump():
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not found:
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        found = os.path.join(os.path.dirname(nvcc), "cuobjdump")
    if not os.path.exists(found):
        sys.exit("compare-sass: no cuobjdump (set CUOBJDUMP, e.g. from `pip install nvidia-cuda-cuobjdump`)")
    return found


def dump(tool, command, tree, out_file):
    """Compiles with `command` in `tree` and writes `{function: text}` (resources line, then SASS) as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        obj = os.path.join(tmp, "x.o")
        cmd = [w.replace("{tree}", tree).replace("{out}", obj) for w in command]
        r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"compare-sass: compiling in {tree} failed:\n{r.stderr[-4000:]}")
        subprocess.run([tool, "-xelf", "all", obj], cwd=tmp, check=True, capture_output=True)
        cubins = sorted(f for f in os.listdir(tmp) if f.endswith(".cubin"))
        functions = {}
        for cubin in cubins:
            cubin = os.path.join(tmp, cubin)
            res = subprocess.run([tool, "-res-usage", cubin], check=True, capture_output=True, text=True).stdout
            for name, usage in re.findall(r"Function (\S+):\n\s*(.*)", res):
                functions[name] = usage.strip() + "\n"
            sass = subprocess.run([tool, "-sass", cubin], check=True, capture_output=True, text=True).stdout
            for block in re.split(r"\n\t\tFunction : ", sass)[1:]:
                name, _, body = block.partition("\n")
                functions[name] = functions.get(name, "") + body.split("\n\t\t..........")[0]
    os.makedirs(os.path.dirname(out_file), exist_ok=True)
    json.dump(functions, open(out_file, "w"), indent=0)


def demangle(names):
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return r.stdout.split("\n") if r.returncode == 0 else names


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="git revision to compare against (e.g. main, HEAD)")
    ap.add_argument("files", nargs="*", help=".cu files, relative to the repository root")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="configured build dir (default build)")
    ap.add_argument("--arch", default=",".join(DEFAULT_ARCHS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    commit = git("rev-parse", "--verify", args.base + "^{commit}").strip()
    entries = compile_commands(build)
    files = args.files
    if not files:
        changed = set(git("diff", "--name-only", commit, "--", "src", "include").split())
        files = [f for f in sorted(entries) if quoted_includes(ROOT, f, set()) & changed]
        if not files:
            print(f"compare-sass: no .cu file of the build differs from {args.base} or includes a changed header")
            return 0
    for f in files:
        if f not in entries:
            sys.exit(f"compare-sass: {f} is not a .cu file of {build}")
    tool = cuobjdump()

    sass_dir = os.path.join(build, "sass")
    base_tree = os.path.join(sass_dir, "trees", commit)
    if not os.path.isdir(base_tree):
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "src", "include"], check=True,
                                 capture_output=True).stdout
        tmp = base_tree + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with tarfile.open(fileobj=io.BytesIO(archive)) as t:
            t.extractall(tmp)
        os.rename(tmp, base_tree)

    jobs, pairs = [], []
    for arch in args.arch.split(","):
        for f in files:
            command = one_arch_command(entries[f], arch)
            key = hashlib.sha1(" ".join(command).encode()).hexdigest()[:10]  # the flags and the nvcc used
            slug = f.replace("/", "_")
            base_out = os.path.join(sass_dir, "base", f"{commit[:12]}-{key}", f"sm_{arch}", slug + ".json")
            new_out = os.path.join(sass_dir, "worktree", f"sm_{arch}", slug + ".json")
            if not os.path.exists(base_out):
                jobs.append((command, base_tree, base_out))
            jobs.append((command, ROOT, new_out))
            pairs.append((arch, f, base_out, new_out))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for future in [pool.submit(dump, tool, *job) for job in jobs]:
            future.result()

    diff_dir = os.path.join(sass_dir, "diff")
    shutil.rmtree(diff_dir, ignore_errors=True)
    differing = 0
    for arch, f, base_out, new_out in pairs:
        base, new = json.load(open(base_out)), json.load(open(new_out))
        names = sorted(set(base) | set(new))
        changed = [n for n in names if base.get(n) != new.get(n)]
        differing += len(changed)
        print(f"sm_{arch} {f}: {len(names) - len(changed)} of {len(names)} functions identical")
        for name, pretty in zip(changed, demangle(changed)):
            a, b = base.get(name, "").splitlines(), new.get(name, "").splitlines()
            diff = list(difflib.unified_diff(a, b, "base", "worktree", lineterm="", n=2))
            path = os.path.join(diff_dir, f"sm_{arch}", name[:200] + ".diff")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").write(pretty + "\n" + "\n".join(diff) + "\n")
            what = "only in base" if not b else "only in worktree" if not a else f"{len(a)} -> {len(b)} lines"
            print(f"  differs: {pretty} ({what})")
    print("identical" if differing == 0 else f"{differing} functions differ (diffs in {diff_dir})")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
