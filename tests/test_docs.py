"""The documentation says what the code does: README.md and docs/*.md.

- docs/configuration.md lists every Config field (walked recursively, list
  elements included) by its dotted path, with its type and default, and
  nothing else;
- the README's embedding example runs outside the repository, from the
  installed packages only, and prints what the README says it prints;
- the configuration example and the P/D connector example of the docs are
  valid and run;
- every relative link in README.md and docs/*.md resolves to a file.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# the packages a wheel installs (pyproject.toml, tool.scikit-build.wheel.packages)
INSTALLED = {"kvindex", "kvevents", "scorer", "connector"}


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


# ---------------------------------------------------------------------------
# (a) every Config field in docs/configuration.md


def _render_type(tp: object) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " | ".join(_render_type(a) for a in typing.get_args(tp))
    origin = typing.get_origin(tp)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_render_type(a) for a in typing.get_args(tp))}]"
    assert isinstance(tp, type), tp
    return tp.__name__


def _struct_of(tp: object) -> type[msgspec.Struct] | None:
    """The Struct a field holds: itself, or the element type of a list of Structs."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp)
        if isinstance(elem, type) and issubclass(elem, msgspec.Struct):
            return elem
    return None


SECTION = "(its fields)"


def config_fields() -> dict[str, tuple[str, str]]:
    """Dotted path -> (rendered type, rendered default) for every field of Config, recursively."""
    from kvindex.facade.config import Config

    out: dict[str, tuple[str, str]] = {}

    def walk(struct: type[msgspec.Struct], prefix: str) -> None:
        for f in msgspec.structs.fields(struct):
            path = prefix + f.name
            inner = _struct_of(f.type)
            if f.required:
                default = "required"
            elif inner is f.type:
                default = SECTION
            else:
                value = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
                default = json.dumps(msgspec.to_builtins(value))
            out[path] = (_render_type(f.type), default)
            if inner is not None:
                walk(inner, path + ("[]." if inner is not f.type else "."))

    walk(Config, "")
    return out


ROW = re.compile(r"^\| `([a-z_.\[\]]+)` \| `((?:[^`\\]|\\\|)+)` \| (`[^`]*`|required|\(its fields\)) \| (.+) \|$")


def documented_fields() -> dict[str, tuple[str, str]]:
    text = (DOCS / "configuration.md").read_text()
    section = text[text.index("## Fields"):]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        m = ROW.match(line)
        assert m, f"malformed field row: {line}"
        name, tp, default, meaning = m.groups()
        assert name not in rows, f"{name} documented twice"
        assert meaning.strip(), name
        rows[name] = (tp.replace("\\|", "|"), default)
    return rows


def test_every_config_field_is_documented_with_its_type_and_default():
    want = config_fields()
    got = documented_fields()
    assert sorted(set(want) - set(got)) == [], "fields missing from docs/configuration.md"
    assert sorted(set(got) - set(want)) == [], "docs/configuration.md documents fields Config does not have"
    for name, (tp, default) in want.items():
        doc_tp, doc_default = got[name]
        assert doc_tp == tp, f"{name}: documented type {doc_tp!r}, Config says {tp!r}"
        if default in ("required", SECTION):
            assert doc_default == default, f"{name}: documented default {doc_default!r}, expected {default!r}"
        else:
            assert doc_default.startswith("`"), name
            assert json.loads(doc_default.strip("`")) == json.loads(default), (
                f"{name}: documented default {doc_default}, Config says {default}"
            )


def test_the_walk_reaches_nested_and_list_fields():
    fields = config_fields()
    assert fields["kv_block_index_config.in_memory_config.size"] == ("int", "1000000")
    assert fields["kv_events_config.engines[].pod"] == ("str", "required")
    assert fields["kv_block_index_config.backend"] == ("str", '"auto"')
    assert fields["scorer_config.weights"][1] == SECTION


def test_configuration_example_is_a_valid_config():
    from kvindex import Config

    (block,) = _blocks((DOCS / "configuration.md").read_text(), "yaml")
    cfg = Config.from_yaml(block)
    assert cfg.token_processor_config.block_size == 16
    assert cfg.kv_block_index_config.backend == "auto"
    assert cfg.kv_events_config.engines[0].replay_endpoint == "tcp://10.0.0.5:5558"
    # rank 1 of pod-b: the next ports, not colliding with rank 0's
    assert cfg.kv_events_config.engines[1].ranks() == [
        (0, "tcp://10.0.0.6:5557", "tcp://10.0.0.6:5600"),
        (1, "tcp://10.0.0.6:5558", "tcp://10.0.0.6:5601"),
    ]


# ---------------------------------------------------------------------------
# (b) the README's embedding example, run outside the repository

# Run a script with the repository's root taken off sys.path: an editable install may put
# the clone on it (a .pth), and the example must need only what a wheel installs (the
# installed packages still resolve: a virtualenv inside the clone is not the root).
_RUNNER = """
import os, runpy, sys
root = os.path.realpath(sys.argv[1])
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _readme_example() -> tuple[str, str]:
    text = README.read_text()
    m = re.search(r"^```python\n(.*?)^```\n(.*?)^```text\n(.*?)^```", text, re.S | re.M)
    assert m, "README: the first python block must be followed by a text block with its output"
    code, between, expected = m.groups()
    assert "```" not in between, "README: the expected output must come right after the example"
    return code, expected


def test_readme_example_is_short_and_imports_installed_packages_only():
    code, _ = _readme_example()
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 20
    tops = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            tops.add((node.module or "").split(".")[0])
    assert tops <= INSTALLED | set(sys.stdlib_module_names), tops - INSTALLED
    assert "from kvindex import Config, Indexer" in code
    assert "from kvevents.testing import FakeEngine" in code


def test_readme_example_runs_outside_the_repository(tmp_path):
    code, expected = _readme_example()
    script = tmp_path / "example.py"
    script.write_text(code)
    root = os.path.realpath(ROOT)
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != root]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    if not keep:
        del env["PYTHONPATH"]
    assert not str(tmp_path.resolve()).startswith(root)
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, root, str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected


# ---------------------------------------------------------------------------
# examples and facts moved from the README into docs/


def test_user_guide_connector_example_runs(tmp_path):
    text = (DOCS / "user-guide.md").read_text()
    code = next(b for b in _blocks(text, "python") if "PDPlanner" in b)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = (ln for ln in out.stdout.splitlines() if ln[:2] in ("1 ", "2 "))
    assert "recompute" in first
    # turn 2 extends turn 1's prompt + answer: D's retained tokens (prompt + output - 1) are pulled
    assert "pull: prompt 390, local 0, pullable 339, pulled 339" in second


def test_operations_metrics_table_lists_every_family():
    from kvindex.facade.metrics import METRICS

    text = (DOCS / "operations.md").read_text()
    section = text[text.index("## Metrics"):]
    section = section[: section.index("\n## ", 4)]
    documented = set(re.findall(r"^\| `(kvindex_[a-z_]+)`", section, re.M))
    exposed = {n + "_total" if k == "counter" else n for n, (k, _l, _d) in METRICS.items()}
    assert sorted(exposed - documented) == []
    library = {n for n in documented if not n.startswith("kvindex_router_")}
    assert sorted(library - exposed) == [], "documented library metrics the collector does not have"
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `(kvindex_[a-z_]+)` \| ([a-z]+) \| ([a-z_, ]*?) *\|", section, re.M)}
    for name, (kind, labels, _doc) in METRICS.items():
        shown = name + "_total" if kind == "counter" else name
        assert rows[shown] == (kind, ", ".join(labels)), shown


def test_operations_router_metrics_table_lists_every_router_family():
    """The reference router's own families, as its source declares them, with their types."""
    source = "\n".join(p.read_text() for p in sorted((ROOT / "examples" / "router").glob("*.py")))
    declared = {
        name + ("_total" if kind == "Counter" else ""): kind.lower()
        for kind, name in re.findall(r'\b(Counter|Gauge|Histogram)\(\s*"(kvindex_router_[a-z_]+)"', source)
    }
    assert len(declared) >= 19
    text = (DOCS / "operations.md").read_text()
    documented = dict(re.findall(r"^\| `(kvindex_router_[a-z_]+)` \| ([a-z]+) \|", text, re.M))
    assert documented == declared


def test_docs_name_the_current_layout():
    """Module paths of the old layout do not come back (indexer/, kvindex.index, kvindex.protocol)."""
    stale = re.compile(r"\bfrom indexer\b|`indexer[./]|kvindex\.index\b|kvindex\.protocol\b|kvindex/index\.py|kvindex/protocol\.py")
    for doc in [README, *sorted(DOCS.glob("*.md"))]:
        hits = [ln for ln in doc.read_text().splitlines() if stale.search(ln)]
        assert hits == [], f"{doc.name}: {hits}"


def test_backends_documented():
    from kvindex import BACKENDS

    text = (DOCS / "configuration.md").read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| `kv_block_index_config.backend`"))
    for name in BACKENDS:
        assert f"`{name}`" in row, name


# ---------------------------------------------------------------------------
# (4) relative links resolve

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _anchors(path: Path) -> set[str]:
    """GitHub-style heading anchors of a markdown file."""
    out = set()
    for line in path.read_text().splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = doc.read_text()
    # links inside code blocks are not links
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    links = LINK.findall(text)
    for target in links:
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: broken link {target}"
        assert str(dest).startswith(str(ROOT.resolve())), f"{doc.name}: link leaves the repository: {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.name}: no heading for #{anchor} in {dest.name}"


def test_docs_exist_and_readme_is_short():
    for name in ("user-guide", "configuration", "operations", "design", "benchmarks"):
        assert (DOCS / f"{name}.md").is_file(), name
    assert len(README.read_text().splitlines()) <= 250
