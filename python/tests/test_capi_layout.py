"""The ctypes mirrors have the C structs' size and field offsets: the header is compiled with the
system C compiler and asked."""
import ctypes
import os
import shutil
import subprocess

import pytest

from jagflash import _capi

INCLUDE = os.path.join(os.path.dirname(__file__), "..", "..", "include")


def _c_layout(tmp_path):
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include <jagflash/jagflash.h>', 'int main(void) {']
    for struct, c_name in _capi.STRUCTS:
        lines.append(f'  printf("{c_name} size %zu\\n", sizeof({c_name}));')
        for field, _ in struct._fields_:
            lines.append(f'  printf("{c_name} {field} %zu\\n", offsetof({c_name}, {field}));')
    lines.append("  return 0;\n}")
    source, binary = tmp_path / "layout.c", tmp_path / "layout"
    source.write_text("\n".join(lines))
    subprocess.run([_compiler(), "-I", INCLUDE, str(source), "-o", str(binary)], check=True)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}


def _compiler():
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.mark.skipif(not os.path.isdir(INCLUDE) or _compiler() is None, reason="needs a C compiler and include/")
def test_structs_match_the_header(tmp_path):
    c = _c_layout(tmp_path)
    for struct, c_name in _capi.STRUCTS:
        assert ctypes.sizeof(struct) == c[(c_name, "size")], c_name
        for field, _ in struct._fields_:
            assert getattr(struct, field).offset == c[(c_name, field)], f"{c_name}.{field}"
