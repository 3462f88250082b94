"""The house's layout (DESIGN.md): floors, no import circles, small rooms.

The import graph is read from the source with ``ast`` (every import counts:
module level, inside functions and under ``if TYPE_CHECKING:``), so a circle
hidden behind a lazy import is still a circle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("kvindex", "kvevents", "scorer", "connector")
USERS = ("examples", "bench")
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80
#: Functions allowed past MAX_FUNCTION_LINES, with the reason.
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(tops: tuple[str, ...]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _sources(LIBRARY + USERS)
#: compiled modules (no .py source): counted as modules of the floor they sit in
COMPILED = {"kvindex._native"}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> Iterator[str]:
    known = MODULES.keys() | COMPILED
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                yield alias.name
        return
    base = node.module or ""
    if node.level:
        pkg = importer.split(".") if is_package else importer.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            yield sub
        elif base in known:
            yield base


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (anywhere in its source)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(d for d in _resolve(name, is_pkg, node) if d != name)
        graph[name] = deps
    return graph


def floor(module: str) -> tuple[int, str]:
    """(floor, room) of a module: DESIGN.md's floors, bottom 0."""
    top = module.split(".")[0]
    if top in USERS:
        return 3, top
    if module == "kvindex" or module.startswith("kvindex.facade"):
        return 2, "facade"
    if top == "connector":
        return 2, "connector"
    if top in ("kvevents", "scorer"):
        return 1, top
    return 0, "ground"


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert find_cycles(import_graph()) == []


def test_imports_point_down_or_sideways():
    bad = []
    for mod, deps in import_graph().items():
        f, room = floor(mod)
        for dep in deps:
            g, droom = floor(dep)
            if g > f:
                bad.append(f"{mod} (floor {f}) imports {dep} (floor {g})")
            elif g == f and room != droom and f in (1, 2):
                # kvevents and scorer never import each other; connector and the facade neither
                bad.append(f"{mod} ({room}) imports {dep} ({droom}) sideways")
    assert bad == []


def test_the_checks_see_a_circle_and_a_wrong_floor():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floor("kvindex.reference") < floor("kvevents.pool") < floor("kvindex.facade.indexer")
    assert floor("kvindex") == floor("kvindex.facade")


def _library_files() -> Iterator[Path]:
    for top in LIBRARY:
        yield from sorted((ROOT / top).rglob("*.py"))
    for pattern in ("*.cpp", "*.h"):
        yield from sorted((ROOT / "native").glob(pattern))


def test_no_library_file_over_the_limit():
    big = {
        str(p.relative_to(ROOT)): n
        for p in _library_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert big == {}


def long_python_functions() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in _library_files():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - start + 1
                if n > MAX_FUNCTION_LINES:
                    out[f"{_module_name(path)}:{node.name}"] = n
    return out


_CONTROL = ("if", "for", "while", "switch", "catch", "else", "do", "return", "try")
_FUNC_TAIL = re.compile(r"\)\s*(const|noexcept|override|final|mutable|\s)*(->[^{};]*)?(:[^{};]*)?$")


def _strip_cpp(text: str) -> str:
    """Comments, string and char literals blanked out; newlines kept."""
    pattern = r'//[^\n]*|/\*.*?\*/|"(\\.|[^"\\\n])*"|\'(\\.|[^\'\\\n])*\''
    return re.sub(pattern, lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)


def cpp_function_lengths(text: str) -> dict[str, int]:
    """Function name -> lines, for every function body in C++ source (lambdas count in their function)."""
    src = _strip_cpp(text)
    out: dict[str, int] = {}
    stack: list[tuple[bool, int, str]] = []  # (is a function body, head line, name)
    stmt_start = 0
    for i, ch in enumerate(src):
        if ch not in "{};":
            continue
        if ch == "{":
            head = src[stmt_start:i].strip()
            inside = any(f for f, _, _ in stack)
            words = re.findall(r"[A-Za-z_]\w*", head)
            func = (
                not inside and bool(_FUNC_TAIL.search(head)) and bool(words) and words[0] not in _CONTROL
                and "=" not in head.split("(")[0]
            )
            name = ""
            if func:
                m = re.search(r"([A-Za-z_][\w:~]*)\s*\(", head)
                name = m.group(1) if m else "?"
            line = src.count("\n", 0, stmt_start + (len(src[stmt_start:i]) - len(src[stmt_start:i].lstrip())))
            stack.append((func, line, name))
        elif ch == "}" and stack:
            func, line, name = stack.pop()
            if func:
                n = src.count("\n", 0, i) - line + 1
                out[name] = max(n, out.get(name, 0))
        stmt_start = i + 1
    return out


def long_cpp_functions() -> dict[str, int]:
    """Functions of native/ longer than the limit."""
    out: dict[str, int] = {}
    for path in _library_files():
        if path.suffix in (".cpp", ".h"):
            for name, n in cpp_function_lengths(path.read_text()).items():
                if n > MAX_FUNCTION_LINES:
                    out[f"{path.name}:{name}"] = n
    return out


def test_no_library_function_over_the_limit():
    long = {k: v for k, v in {**long_python_functions(), **long_cpp_functions()}.items()
            if k not in LONG_FUNCTIONS_ALLOWED}
    assert long == {}


def test_the_cpp_length_check_reads_functions_and_skips_the_rest():
    src = (
        "struct S {\n  int f(int a) const {\n    if (a) {\n      return 1;\n    }\n"
        "    auto g = [&](int b) { return b; };\n    return g(a);\n  }\n};\n"
        "static const char* s = \"{ not a brace\";\n"
        "Foo::Foo(int x)\n    : x_(x) {\n  // }\n}\n"
    )
    assert cpp_function_lengths(src) == {"f": 7, "Foo::Foo": 4}
