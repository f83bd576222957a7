"""Imports only go downward: the README's layer table is the rule, the package's imports the facts.

Every module of the package sits in one row of the table in README.md's "Architecture" section
(a layer number, then the modules in backticks: `config.py`, or a whole subpackage `attention/`).
A module may import from its own layer or a lower one, never a higher one, and no set of modules
may import each other in a circle. Imports inside functions count too: a deferred import is still
a dependency. The package's own `__init__.py` is the public facade above every layer (it imports
lazily), so it is the one module outside the table.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "xdit_lab"
ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")


def layer_table() -> dict[str, int]:
    """{'config.py': 1, 'attention/': 3, ...} from the README's architecture table."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Architecture") :]
    end = section.find("\n## ", 4)  # the next section, if Architecture is not the README's last
    section = section if end < 0 else section[:end]
    table = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            for name in re.findall(r"`([^`]+)`", match.group(2)):
                table[name] = int(match.group(1))
    return table


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer_of(name: str, table: dict[str, int]) -> int | None:
    entry = entry_of(name, table)
    return None if entry is None else table[entry]


def entry_of(name: str, table: dict[str, int]) -> str | None:
    """The README table's entry a module belongs to: its own file, or the subpackage it sits in."""
    relative = name.split(".", 1)[1] if "." in name else ""
    path = relative.replace(".", "/")
    return next((key for key in (f"{path}.py", f"{path}/", f"{path.split('/')[0]}/") if key in table), None)


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import xdit_lab.lab.views as v` names a module
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target.startswith("xdit_lab") and target != name:
                found.add(target)
    return found


def test_every_module_has_a_layer():
    table = layer_table()
    assert len(table) > 10, "README.md's architecture table was not found"
    missing = sorted(n for n in modules() if n != "xdit_lab" and layer_of(n, table) is None)
    assert not missing, f"add these modules to README.md's layer table: {missing}"


def test_imports_only_go_downward():
    table, known = layer_table(), modules()
    upward = []
    for name, path in known.items():
        if name == "xdit_lab":
            continue
        for target in imports(name, path, known):
            if target == "xdit_lab":
                upward.append(f"{name} imports the package facade xdit_lab; import the module itself")
            elif layer_of(target, table) > layer_of(name, table):
                upward.append(
                    f"{name} (layer {layer_of(name, table)}) imports {target} (layer {layer_of(target, table)})"
                )
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, path, known) - {"xdit_lab"} for name, path in known.items() if name != "xdit_lab"}
    # A package imports its own children by design (its __init__ re-exports them); a child that
    # imports its package's __init__ back would close a circle, so those edges stay in.
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, f"modules that import each other in a circle: {cycles}"


def test_the_rules_catch_what_they_are_for(tmp_path):
    """Controls: an upward import and a circle, written into a copy of the facts, are found."""
    table = {"low.py": 1, "high.py": 2}
    assert layer_of("xdit_lab.low", table) == 1 and layer_of("xdit_lab.high", table) == 2
    package = tmp_path / "xdit_lab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from .high import g  # deferred, still upward\n")
    (package / "high.py").write_text("from . import low\n")
    known = {"xdit_lab.low": package / "low.py", "xdit_lab.high": package / "high.py", "xdit_lab": package}
    assert imports("xdit_lab.low", package / "low.py", known) == {"xdit_lab.high"}
    assert imports("xdit_lab.high", package / "high.py", known) == {"xdit_lab.low"}


def test_every_row_names_modules_that_exist():
    missing = [name for name in layer_table() if not (PACKAGE / name).exists()]
    assert not missing, f"README.md's layer table names modules that do not exist: {missing}"


def floors(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """For every node of an acyclic import graph, its longest chain of imports downward (itself first)."""
    chains: dict[str, list[str]] = {}

    def chain(node):
        if node not in chains:
            below = max((chain(target) for target in graph.get(node, ())), key=len, default=[])
            chains[node] = [node, *below]
        return chains[node]

    for node in graph:
        chain(node)
    return chains


MOST_FLOORS = 10


def test_the_house_is_at_most_ten_floors_deep():
    """The longest chain of imports between the README table's entries (a subpackage is one entry: its
    modules import each other freely) climbs at most ten floors. A deep house makes every change at the
    bottom travel through every floor above it."""
    table, known = layer_table(), modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        if name == "xdit_lab":
            continue
        entry = entry_of(name, table)
        targets = {entry_of(target, table) for target in imports(name, path, known) - {"xdit_lab"}}
        graph.setdefault(entry, set()).update(targets - {entry})
    deepest = max(floors(graph).values(), key=len)
    assert len(deepest) <= MOST_FLOORS, f"{len(deepest)} floors: " + " -> ".join(deepest)
    assert len(set(table.values())) <= MOST_FLOORS, "README's layer table has more layers than the floors allowed"


def test_floors_count_the_longest_chain():
    """Control: a chain of eleven entries is eleven floors, whatever shorter chains beside it."""
    graph = {f"m{i}": {f"m{i + 1}"} for i in range(10)} | {"m10": set(), "side": {"m9"}}
    assert len(floors(graph)["m0"]) == 11 and len(floors(graph)["side"]) == 3


def test_the_facade_offers_the_lab_and_still_starts_without_ipyparallel():
    """`from xdit_lab import Lab` is the notebook Lab (xdit_lab.lab.Lab), and the facade stays lazy: a fresh
    `import xdit_lab` loads no ipyparallel (the CLI's quick start). Control: the first use of Lab does load it."""
    script = (
        "import sys, xdit_lab\n"
        "print('ipyparallel' in sys.modules)\n"
        "from xdit_lab import Lab, LabError, LabSession\n"
        "import xdit_lab.lab\n"
        "print(Lab is xdit_lab.lab.Lab, LabSession is xdit_lab.lab.LabSession, LabError is xdit_lab.lab.LabError)\n"
        "print('ipyparallel' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == ["False", "True True True", "True"], result.stdout
