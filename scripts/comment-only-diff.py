#!/usr/bin/env python3
"""Checks that a change touched only comments: for every changed source file, the old version
(from a git revision) and the new one (the working tree) must give the same code once their
comments are stripped.

  usage: scripts/comment-only-diff.py [--base REV] [--strict-docstrings] [PATH ...]
         scripts/comment-only-diff.py --list-comments PATH ...
         scripts/comment-only-diff.py --self-test

--base REV: the old versions (default: the merge base of main and HEAD); --new REV: the new
versions (default: the working tree). Without PATHs, every file
that git tracks and that differs between REV and the working tree is checked (files added
are listed and not compared, a deleted source file fails; non-source files such as Markdown are
listed as skipped).

What counts as a comment:
  C, C++, CUDA (.c .cc .cpp .h .hpp .cu .cuh; templates NAME.in as NAME): // and /* */, outside string and character
    literals (raw strings R"d(...)d" included). The rest is compared as a token stream
    (identifiers, numbers, literals, punctuation), so clang-format's re-wrapping of a line whose
    trailing comment changed does not count; a changed token does.
  Python (.py): # comments (Python's own tokenizer); docstrings (the first string statement of a
    module, class or function) count as comments too unless --strict-docstrings, and each file
    whose docstrings changed is named. Tokens are compared with indentation and logical newlines.
  CMake (CMakeLists.txt, .cmake) and shell (.sh, .bash, files with a sh/bash shebang): # comments
    outside quotes (CMake's #[[ ]] bracket comments too); lines are compared with whitespace runs
    collapsed and blank lines dropped.
--list-comments prints each comment of the PATHs with its file and line (for reading them all).
Exit status: 0 when every checked file changed only in comments, 1 otherwise, 2 on usage errors.
"""
import argparse
import ast
import io
import os
import re
import subprocess
import sys
import tokenize

C_EXT = {".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh"}
PY_EXT = {".py"}
CMAKE_EXT = {".cmake"}
SH_EXT = {".sh", ".bash"}


def kind_of(path, text=None):
    name = os.path.basename(path)
    if name.endswith(".in"):  # a CMake template (x.cu.in, x.cmake.in) is read as what it configures
        name = name[:-3]
    ext = os.path.splitext(name)[1]
    if name == "CMakeLists.txt" or ext in CMAKE_EXT:
        return "cmake"
    if ext in PY_EXT:
        return "python"
    if ext in SH_EXT:
        return "shell"
    if ext in C_EXT:
        return "c"
    if text is not None and text.startswith("#!"):
        first = text.split("\n", 1)[0]
        if "python" in first:
            return "python"
        if re.search(r"\b(ba)?sh\b", first):
            return "shell"
    return None


# ---------------------------------------------------------------- C, C++, CUDA

def c_split(text):
    """(code with each comment replaced by one space, [(line, comment text)])."""
    out, comments = [], []
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = i
            # a backslash before the newline continues a // comment onto the next line
            while j < n and text[j] != "\n":
                if text[j] == "\\" and j + 1 < n and text[j + 1] == "\n":
                    j += 2
                    continue
                j += 1
            comments.append((line, text[i:j]))
            line += text.count("\n", i, j)
            out.append(" ")
            i = j
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            if j < 0:
                raise ValueError(f"unterminated /* comment at line {line}")
            j += 2
            comments.append((line, text[i:j]))
            line += text.count("\n", i, j)
            out.append(" ")
            i = j
        elif c == "R" and i + 1 < n and text[i + 1] == '"' and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
                                                               or text[i - 1] in "uUL8"):
            m = re.match(r'R"([^()\\ \t\n]{0,16})\(', text[i:])
            if not m:
                raise ValueError(f"malformed raw string at line {line}")
            end = text.find(")" + m.group(1) + '"', i + m.end())
            if end < 0:
                raise ValueError(f"unterminated raw string at line {line}")
            end += len(m.group(1)) + 2
            out.append(text[i:end])
            line += text.count("\n", i, end)
            i = end
        elif c == '"' or (c == "'" and not (i > 0 and text[i - 1].isalnum() and _digit_separator(text, i))):
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    raise ValueError(f"newline in a {c} literal at line {line}")
                j += 1
            j += 1
            out.append(text[i:j])
            i = j
        else:
            if c == "\n":
                line += 1
            out.append(c)
            i += 1
    return "".join(out), comments


def _digit_separator(text, i):
    """Whether the ' at i is a C++14 digit separator (1'000'000), not a character literal."""
    j = i - 1
    while j >= 0 and (text[j].isalnum() or text[j] in "'._"):
        j -= 1
    word = text[j + 1:i]
    return bool(word) and word[0].isdigit()


C_TOKEN = re.compile(r'''
    (?P<str>(?:u8|[uUL])?R"(?P<d>[^()\\ \t\n]{0,16})\(.*?\)(?P=d)"
          |(?:u8|[uUL])?"(?:\\.|[^"\\\n])*"
          |(?:u8|[uUL])?'(?:\\.|[^'\\\n])*')
   |(?P<num>\.?[0-9](?:[eEpP][+-]|[0-9A-Za-z_.']|)*)
   |(?P<id>[A-Za-z_][A-Za-z_0-9]*)
   |(?P<punct>::|->\*?|\.\.\.|<<=|>>=|<=>|&&|\|\||\+\+|--|[-+*/%&|^!=<>]=|<<|>>|\#\#|[^\sA-Za-z_0-9])
   |(?P<ws>\s+)
''', re.X | re.S)


def c_tokens(code):
    toks, pos = [], 0
    # a backslash-newline (macro continuation) is whitespace to the token stream
    code = code.replace("\\\n", " ")
    while pos < len(code):
        m = C_TOKEN.match(code, pos)
        if not m:
            raise ValueError(f"cannot tokenize at {code[pos:pos + 40]!r}")
        if m.lastgroup != "ws":
            toks.append(m.group(0))
        pos = m.end()
    # preprocessor directives end at the line end: a comment's removal may not join two of them,
    # which the token stream would not see; mark each directive's line end.
    return toks


def c_code_lines_of_directives(code):
    return [re.sub(r"\s+", " ", l).strip() for l in code.replace("\\\n", " ").split("\n")
            if l.lstrip().startswith("#")]


# ---------------------------------------------------------------- Python

def py_docstring_positions(text):
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise ValueError(f"not Python: {e}")
    pos = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                pos.add((body[0].value.lineno, body[0].value.col_offset))
    return pos


def py_split(text, docstrings_are_comments=True):
    """(token stream, [(line, comment)], [docstring texts])."""
    doc_pos = py_docstring_positions(text)
    toks, comments, docs = [], [], []
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.COMMENT:
            comments.append((t.start[0], t.string))
        elif t.type in (tokenize.NL, tokenize.ENDMARKER):
            continue
        elif t.type == tokenize.STRING and t.start in doc_pos:
            docs.append(t.string)
            comments.append((t.start[0], t.string))
            toks.append((tokenize.STRING, "<docstring>" if docstrings_are_comments else t.string))
        elif t.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
            # the indentation's depth, not its spelling
            toks.append((t.type, ""))
        else:
            toks.append((t.type, t.string))
    return toks, comments, docs


# ---------------------------------------------------------------- CMake and shell

def hash_split(text, kind):
    """(code lines, [(line, comment)]) for # comments outside quotes."""
    lines_out, comments = [], []
    i, n, line = 0, len(text), 1
    cur, quote = [], None
    while i < n:
        c = text[i]
        if quote:
            cur.append(c)
            if c == "\\" and quote == '"' and i + 1 < n:
                cur.append(text[i + 1])
                if text[i + 1] == "\n":
                    line += 1
                i += 2
                continue
            if c == "\n":
                line += 1
            if c == quote:
                quote = None
            i += 1
            continue
        if kind == "cmake" and text.startswith("#[", i) and re.match(r"#\[=*\[", text[i:]):
            eq = re.match(r"#\[(=*)\[", text[i:]).group(1)
            end = text.find("]" + eq + "]", i)
            if end < 0:
                raise ValueError(f"unterminated bracket comment at line {line}")
            end += len(eq) + 2
            comments.append((line, text[i:end]))
            line += text.count("\n", i, end)
            cur.append(" ")
            i = end
            continue
        if kind == "cmake" and text.startswith("[", i) and re.match(r"\[=*\[", text[i:]):
            eq = re.match(r"\[(=*)\[", text[i:]).group(1)
            end = text.find("]" + eq + "]", i)
            if end >= 0:
                end += len(eq) + 2
                cur.append(text[i:end])
                line += text.count("\n", i, end)
                i = end
                continue
        if c == "\\" and i + 1 < n:
            cur.append(text[i:i + 2])
            if text[i + 1] == "\n":
                line += 1
            i += 2
            continue
        if c == '"' or (c == "'" and kind == "shell"):
            quote = c
            cur.append(c)
            i += 1
            continue
        if c == "#" and (kind == "cmake" or not cur or cur[-1] in " \t\n;|&()"):
            j = text.find("\n", i)
            j = n if j < 0 else j
            comments.append((line, text[i:j]))
            i = j
            continue
        if c == "\n":
            lines_out.append("".join(cur))
            cur = []
            line += 1
            i += 1
            continue
        cur.append(c)
        i += 1
    if quote:
        raise ValueError(f"unterminated {quote} quote")
    lines_out.append("".join(cur))
    code = [re.sub(r"[ \t]+", " ", l).strip() for l in lines_out]
    return [l for l in code if l], comments


# ---------------------------------------------------------------- comparison

def code_of(text, kind, docstrings_are_comments=True):
    """What must not change: a comparable object, the comments and any docstrings."""
    if kind == "c":
        code, comments = c_split(text)
        return (c_tokens(code), c_code_lines_of_directives(code)), comments, []
    if kind == "python":
        return py_split(text, docstrings_are_comments)
    code, comments = hash_split(text, kind)
    return code, comments, []


def first_difference(a, b):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            d = first_difference(x, y)
            if d:
                return d
        return None
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"item {k}: {x!r} (old) != {y!r} (new); old context {a[max(0, k - 5):k + 5]!r}"
    if len(a) != len(b):
        return f"lengths differ: {len(a)} (old) vs {len(b)} (new)"
    return None


def comment_blocks(comments):
    """The comments as a reader counts them: a run of one-line comments on consecutive lines is one
    comment (its text with each line's marker and indentation dropped)."""
    blocks, last = [], None
    for line, c in comments:
        text = " ".join(c.split())
        if last is not None and line == last + 1 and "\n" not in c and blocks[-1][1]:
            blocks[-1][0].append(text)
        else:
            blocks.append([[text], "\n" not in c])
        last = line + c.count("\n")
    return [" ".join(b) for b, _ in blocks]


def git(*args, check=True):
    r = subprocess.run(["git", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise SystemExit(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def read_new(path, new):
    """The new version's text, None where it does not exist."""
    if new is None:
        return open(path, encoding="utf-8").read() if os.path.exists(path) else None
    r = subprocess.run(["git", "show", f"{new}:{path}"], capture_output=True, text=True)
    return None if r.returncode else r.stdout


def check(base, paths, strict_docstrings, new=None):
    failures, checked, skipped, docs_changed, comments_changed = 0, 0, [], [], 0
    for path in paths:
        old = subprocess.run(["git", "show", f"{base}:{path}"], capture_output=True, text=True)
        new_text = read_new(path, new)
        if old.returncode or new_text is None:
            print(f"FAIL {path}: {'added' if old.returncode else 'deleted'} (not a comment change)")
            failures += 1
            continue
        kind = kind_of(path, new_text)
        if kind is None:
            skipped.append(path)
            continue
        try:
            a, ca, da = code_of(old.stdout, kind, not strict_docstrings)
            b, cb, db = code_of(new_text, kind, not strict_docstrings)
        except ValueError as e:
            print(f"FAIL {path}: {e}")
            failures += 1
            continue
        checked += 1
        d = first_difference(a, b)
        if d:
            print(f"FAIL {path} ({kind}): code differs: {d}")
            failures += 1
            continue
        if da != db:
            docs_changed.append(path)
        n_old, n_new = comment_blocks(ca), comment_blocks(cb)
        changed = sum(1 for c in n_new if c not in n_old)
        comments_changed += changed
        print(f"ok   {path} ({kind}): comment-only; {len(n_new)} comments, {changed} new or rewritten")
    for p in skipped:
        print(f"skip {p}: not a source file this script reads")
    if docs_changed:
        print("docstrings changed (counted as comments): " + ", ".join(docs_changed))
    print(f"{checked} files checked, {failures} failed, {len(skipped)} skipped; "
          f"{comments_changed} comments new or rewritten (a run of one-line comments counts as one)")
    return 1 if failures else 0


def self_test():
    ok = True

    def expect(cond, what):
        nonlocal ok
        if not cond:
            print("self-test FAILED:", what)
            ok = False

    c_old = 'int f(int x) {  // add one\n  return x + 1; /* done */\n}\nconst char* s = "// not a comment";\n'
    c_new = 'int f(int x) {  // adds one, as the caller expects\n  return x + 1;\n}\nconst char* s = "// not a comment";\n'
    c_bad = 'int f(int x) {  // add one\n  return x + 2;\n}\nconst char* s = "// not a comment";\n'
    c_str = 'int f(int x) {  // add one\n  return x + 1;\n}\nconst char* s = "// not a comment!";\n'
    expect(first_difference(code_of(c_old, "c")[0], code_of(c_new, "c")[0]) is None, "C comment change")
    expect(first_difference(code_of(c_old, "c")[0], code_of(c_bad, "c")[0]) is not None, "C code change")
    expect(first_difference(code_of(c_old, "c")[0], code_of(c_str, "c")[0]) is not None, "C string change")
    expect(first_difference(code_of("int a = 1'000; // x\n", "c")[0], code_of("int a = 1'000;\n", "c")[0]) is None,
           "C digit separator")
    expect(first_difference(code_of('auto r = R"(a // b)"; // c\n', "c")[0],
                            code_of('auto r = R"(a // b)";\n', "c")[0]) is None, "C raw string")
    expect(first_difference(code_of('#define A 1 // x\n#define B 2\n', "c")[0],
                            code_of('#define A 1 #define B 2\n', "c")[0]) is not None, "C directive lines")
    py_old = 'def f(x):\n    """Adds one (measured)."""\n    return x + 1  # one\n'
    py_new = 'def f(x):\n    """Adds one."""\n    # why: the caller counts from one\n    return x + 1\n'
    py_bad = 'def f(x):\n    """Adds one."""\n    return x + 1 if x else 0\n'
    py_str = 'def f(x):\n    """Adds one."""\n    return "# no" + x\n'
    expect(first_difference(code_of(py_old, "python")[0], code_of(py_new, "python")[0]) is None, "Python comment")
    expect(first_difference(code_of(py_old, "python", False)[0], code_of(py_new, "python", False)[0]) is not None,
           "Python docstring under --strict-docstrings")
    expect(first_difference(code_of(py_old, "python")[0], code_of(py_bad, "python")[0]) is not None, "Python code")
    expect(first_difference(code_of(py_str, "python")[0], code_of(py_str.replace("# no", "# yes"), "python")[0])
           is not None, "Python # in a string")
    sh_old = 'echo "a # b" $# ${#x}  # say it\nx=1\n'
    sh_new = '# first\necho "a # b" $# ${#x}\nx=1\n'
    sh_bad = 'echo "a # c" $# ${#x}\nx=1\n'
    expect(first_difference(code_of(sh_old, "shell")[0], code_of(sh_new, "shell")[0]) is None, "shell comment")
    expect(first_difference(code_of(sh_old, "shell")[0], code_of(sh_bad, "shell")[0]) is not None, "shell string")
    cm_old = 'set(A "x#y") # why\n#[[ block\n]]\nadd_library(a b)\n'
    cm_new = '# reason\nset(A "x#y")\nadd_library(a b)\n'
    cm_bad = 'set(A "x#y")\nadd_library(a c)\n'
    expect(first_difference(code_of(cm_old, "cmake")[0], code_of(cm_new, "cmake")[0]) is None, "CMake comment")
    expect(first_difference(code_of(cm_old, "cmake")[0], code_of(cm_bad, "cmake")[0]) is not None, "CMake code")
    print("comment-only-diff self-test: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*")
    p.add_argument("--base", default=None)
    p.add_argument("--new", default=None, help="compare with this revision instead of the working tree")
    p.add_argument("--strict-docstrings", action="store_true")
    p.add_argument("--list-comments", action="store_true")
    p.add_argument("--self-test", action="store_true")
    args = p.parse_args()
    if args.self_test:
        return self_test()
    top = git("rev-parse", "--show-toplevel").strip()
    if args.list_comments:
        for path in args.paths:
            text = open(path, encoding="utf-8").read()
            kind = kind_of(path, text)
            if kind is None:
                continue
            for line, c in code_of(text, kind)[1]:
                print(f"{path}:{line}: {c}")
        return 0
    # paths are relative to the repository root (git show's REV:PATH reads them so)
    os.chdir(top)
    base = args.base or git("merge-base", "main", "HEAD").strip()
    print(f"base {base}")
    if args.paths:
        return check(base, args.paths, args.strict_docstrings, args.new)
    paths, bad, other = [], 0, []
    for row in git("diff", "--name-status", "--no-renames", base, *([args.new] if args.new else []), "--").split("\n"):
        if not row:
            continue
        status, path = row.split("\t", 1)
        if status == "M":
            paths.append(path)
        elif kind_of(path) is None:
            other.append(f"{path} ({status})")
        elif status == "A":
            print(f"new  {path}: added (not compared)")
        else:
            print(f"FAIL {path}: {status} (a source file deleted or changed in kind)")
            bad += 1
    if other:
        print(f"skip {len(other)} other files added, deleted or changed (not sources): " + ", ".join(other[:5])
              + (", ..." if len(other) > 5 else ""))
    if not paths:
        print(f"no file modified since {base}")
        return 1 if bad else 0
    return max(bad and 1, check(base, paths, args.strict_docstrings, args.new))


if __name__ == "__main__":
    sys.exit(main())
