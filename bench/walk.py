"""The walk from ``solvers.solve`` to the plan, measured as in the architecture review (§2.1): how many of the
project's files a reader of ``solve`` follows, and how often they go back into one already read.

    PYTHONPATH=. python bench/walk.py [--chain FILE]             # this checkout
    python bench/walk.py --before ../walk-before --after .    # two checkouts, each in a process of its own

Both on one chain (default: examples/example-L24.chain.json beside this script), ``solve`` called with the
checkout's spelling: keywords (``update=``, ``host_stages=``, ``accumulate=``, ``weights=``) or ``setup=``.

Dynamic trace: ``sys.setprofile`` on a call of ``solve`` per path (after an untraced one: numba warm), counting the
frames of the checkout's files (not this script), none below a module body (an import). The run is in the file of
its innermost such frame; a move is a change of that file, by a call or a return. Figures: files; moves, each
(from, to) pair once however often a loop repeats it; moves back, those into a file visited before the move first
happened; file -> file calls; depth, the most such frames at once; entries into ``solve`` (above 1: recursion).

Static walk (``ast``, every branch) from ``solve`` through the project functions a function names, in source
order: module-level ones (its module's, imported, or ``module.name``), those in a module-level dict/list/tuple it
names (the solver registries), ``__init__``/``__post_init__`` of a class it calls, and ``X.name`` (defined in the
class; properties too) for X a class, a call of one, ``self``/``cls`` or a local whose class its annotation or ``x
= Class(...)`` gives. Depth first, each function expanded once. The walker's place is the file it reads: it goes
into a callee's file, and climbs back into the caller's to read the caller's next callee; equal consecutive places
are one stay. Figures: functions, files, stays, returns = stays - files.
"""

import argparse
import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
PATHS = {  # name: (budget: share of the store-all peak, setup fields (keyword weights=), copies over CHANNEL B/s)
    "(a) plain": ("50%", {}, False),
    "(b) update in-backward": ("50%", {"update": "in-backward"}, False),
    "(c) update on-host, stages 0-11": ("50%", {"update": "on-host", "host_stages": tuple(range(12))}, True),
    "(d) accumulate 4": ("50%", {"accumulate": 4}, False),
    "(e) host weights 1,3": ("80%", {"host_weights": "1,3"}, True),
}
CHANNEL = 1e9
DEFS, LISTS = (ast.FunctionDef, ast.AsyncFunctionDef), (ast.Dict, ast.List, ast.Tuple, ast.Set)
PACKAGES = ("planner", "solvers", "profiles")  # with cli.py, the code the static walk reads


class Trace:
    """The ``sys.setprofile`` hook: the file being run, as it moves among the project's files below frame ``base``."""

    def __init__(self, root: str, base, entry):
        self.base, self.entry, self.place, self.visited, self.moves, self.calls = base, entry, None, set(), set(), set()
        self.back = self.depth = self.entries = 0  # distinct moves back, most project frames, entries into solve
        self.ours = lambda code: (code.co_filename.startswith(root) and code.co_filename != str(HERE)  # project's
                                  and "site-packages" not in code.co_filename)  # (not a virtualenv in the checkout)

    def __call__(self, frame, event, arg):
        if event not in ("call", "return") or not self.ours(frame.f_code):
            return
        caller, depth, above = None, 1, frame.f_back
        while above is not self.base:
            if above is None or above.f_code.co_name == "<module>":
                return  # not below the traced call, or inside an import
            if self.ours(above.f_code):
                caller, depth = caller or above.f_code.co_filename, depth + 1
            above = above.f_back
        here = place = frame.f_code.co_filename
        if event == "call":
            self.entries, self.depth = self.entries + (frame.f_code is self.entry), max(self.depth, depth)
            self.calls |= {(caller, here)} if caller not in (None, here) else set()
        else:
            place = caller  # a return: the run is back in the caller's file (None: out of the traced call)
        if place:
            if self.place not in (None, place) and (self.place, place) not in self.moves:
                self.moves.add((self.place, place))
                self.back += place in self.visited
            self.place = place
            self.visited.add(place)


def traced(root: str, call, entry) -> dict:
    """The dynamic figures of ``call()``: project frames, those of files under ``root``; ``entry``: solve's code."""
    call()  # warm: numba's kernels compiled or loaded before the trace
    hook = Trace(root, sys._getframe(), entry)
    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    package = lambda path: os.path.dirname(os.path.relpath(path, root)).replace(os.sep, ".") or "."  # noqa: E731
    return {"files": len(hook.visited), "moves": len(hook.moves), "back": hook.back, "calls": len(hook.calls),
            "depth": hook.depth, "solves": hook.entries,
            "packages": sorted({f"{package(a)}->{package(b)}" for a, b in hook.calls if package(a) != package(b)})}


class Project:
    """The checkout's modules by ``ast``: what a name stands for in each, and the functions a function names.
    A binding is ("module", m), ("function", m, qualname), ("class", m, name, node) or ("list", m, value)."""

    def __init__(self, root: Path):
        self.trees, self.functions = {}, {}  # module: its ast; ("function", m, qualname): (node, class binding)
        for path in [root / "cli.py", *(p for d in PACKAGES for p in (root / d).rglob("*.py"))]:
            parts = path.relative_to(root).parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__.py" else (*parts[:-1], path.stem))
            self.trees[name] = ast.parse(path.read_text())
        for module, tree in self.trees.items():
            for node in tree.body:
                self.functions |= {("function", module, node.name): (node, None)} if isinstance(node, DEFS) else {
                    ("function", module, f"{node.name}.{m.name}"): (m, ("class", module, node.name, node))
                    for m in getattr(node, "body", ()) if isinstance(node, ast.ClassDef) and isinstance(m, DEFS)}

    def binding(self, module: str, name: str):
        """What ``name`` is in ``module`` (by its module-level statements)."""
        for statement in self.trees[module].body if module in self.trees else ():
            if isinstance(statement, DEFS) and statement.name == name:
                return ("function", module, name)
            if isinstance(statement, ast.ClassDef) and statement.name == name:
                return ("class", module, name, statement)
            if isinstance(statement, ast.Assign) and any(getattr(t, "id", None) == name for t in statement.targets):
                return ("list", module, statement.value) if isinstance(statement.value, LISTS) else None
            for alias in statement.names if isinstance(statement, (ast.Import, ast.ImportFrom)) else ():
                if isinstance(statement, ast.ImportFrom) and (alias.asname or alias.name) == name:
                    full = f"{statement.module}.{alias.name}"  # what the package binds comes before its submodule
                    return self.binding(statement.module, alias.name) or (
                        ("module", full) if full in self.trees else None)
                if isinstance(statement, ast.Import) and (alias.asname or alias.name.split(".")[0]) == name:
                    full = alias.name if alias.asname else name
                    return ("module", full) if full in self.trees else None
        return None

    def method(self, cls, name: str):
        """The function ``name`` defined in the class binding ``cls`` (None: not there)."""
        key = ("function", cls[1], f"{cls[2]}.{name}")
        return key if key in self.functions else None

    def resolve(self, node, module: str, types: dict):
        """The binding an expression stands for (``types``: a function's locals, with their class when known)."""
        if isinstance(node, ast.Name):
            return types.get(node.id) or (None if node.id in types else self.binding(module, node.id))
        if isinstance(node, ast.Call):  # a class called: an instance of it
            found = self.resolve(node.func, module, types)
            return found if found and found[0] == "class" else None
        owner = self.resolve(node.value, module, types) if isinstance(node, ast.Attribute) else None
        if owner and owner[0] == "module":
            full = f"{owner[1]}.{node.attr}"
            return self.binding(owner[1], node.attr) or (("module", full) if full in self.trees else None)
        return self.method(owner, node.attr) if owner and owner[0] == "class" else None

    def callees(self, key) -> list:
        """The project functions that function ``key`` names, in source order (see the module's docstring)."""
        (node, cls), module = self.functions[key], key[1]
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        types = {n.id: None for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for i, argument in enumerate(arguments):
            found = argument.annotation and self.resolve(argument.annotation, module, {})
            types[argument.arg] = cls if i == 0 and cls else found if found and found[0] == "class" else None
        for n in ast.walk(node):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                found = isinstance(n.value, ast.Call) and self.resolve(n.value, module, types)
                types[n.targets[0].id] = found or types[n.targets[0].id]
        named, called = [], {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
        for n in sorted((n for s in node.body for n in ast.walk(s) if isinstance(n, (ast.Name, ast.Attribute))),
                        key=lambda n: (n.lineno, n.col_offset)):
            found = self.resolve(n, module, types) if isinstance(n.ctx, ast.Load) else None
            if found and found[0] == "list":
                named += [f for v in ast.walk(found[2]) if isinstance(v, (ast.Name, ast.Attribute))
                          and (f := self.resolve(v, found[1], {})) and f[0] == "function"]
            elif found and found[0] == "class" and id(n) in called:
                named += [m for m in (self.method(found, "__init__"), self.method(found, "__post_init__")) if m]
            elif found and found[0] == "function":
                named.append(found)
        return list(dict.fromkeys(named))

    def walk(self) -> dict:
        """The static figures of the walk from ``solvers.solve``."""
        done, places = set(), []
        go = lambda key: places[-1:] != [key[1]] and places.append(key[1])  # noqa: E731 (a module is a file)

        def visit(key):
            done.add(key)
            for callee in self.callees(key):
                if callee not in done:
                    go(key), go(callee), visit(callee)
        go(("function", "solvers", "solve")), visit(("function", "solvers", "solve"))
        files = len(set(places))
        return {"functions": len(done), "files": files, "stays": len(places), "returns": len(places) - files}


def measure(chain_path: str) -> dict:
    """Every figure of the checkout on ``sys.path`` (its root: the folder holding ``solvers``)."""
    import solvers
    from planner.chain import load_chain
    from planner.transfer import Transfer
    from planner.units import parse_budget
    root = Path(solvers.__file__).resolve().parents[1]
    spelling = "setup" if "setup" in inspect.signature(solvers.solve).parameters else "keywords"
    chain, figures, entry = load_chain(chain_path), {}, inspect.unwrap(solvers.solve).__code__
    for name, (share, fields, copies) in PATHS.items():
        budget = parse_budget(share, solvers.store_all_peak(chain, fields.get("accumulate", 1)))
        params = {"transfer": Transfer(CHANNEL, CHANNEL)} if copies else {}
        if spelling == "setup":
            from planner.setup import TrainingSetup
            params["setup"] = TrainingSetup(**fields)
        else:
            params |= {("weights" if k == "host_weights" else k): v for k, v in fields.items()}
        figures[name] = traced(str(root) + os.sep, lambda: solvers.solve(chain, budget, **params), entry)
    return {"spelling": spelling, "static": Project(root).walk(), "paths": figures}


def column(checkout: str, chain: str) -> tuple:
    """``(label, figures)`` of ``checkout``, measured in a process of its own."""
    out = subprocess.run([sys.executable, str(HERE), "--json", "--chain", chain], cwd=checkout, stdout=subprocess.PIPE,
                         text=True, check=True, env=dict(os.environ, PYTHONPATH=str(Path(checkout).resolve()))).stdout
    commit = subprocess.run(["git", "-C", checkout, "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    return f"{checkout} ({commit})", json.loads(out)


def table(columns: list, chain: str) -> None:
    """The figures of each checkout as markdown tables, a cell reading ``first → second``."""
    def rows(header, lines):
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        print("\n".join("| " + " | ".join(" → ".join(map(str, cells)) for cells in line) + " |" for line in lines))
        print()
    print(f"chain {chain}; checkouts", " → ".join(label for label, _ in columns) + "\n")
    rows(["solve called with", "static walk: functions", "files", "stays", "returns"], [[[c["spelling"] for _, c in
          columns], *([c["static"][k] for _, c in columns] for k in ("functions", "files", "stays", "returns"))]])
    rows(["dynamic trace of solve", "files", "moves", "moves back", "distinct calls", "depth", "solve entries"],
         [[[f"{name} at {share}"], *([c["paths"][name][k] for _, c in columns]
                                     for k in ("files", "moves", "back", "calls", "depth", "solves"))]
          for name, (share, _, _) in PATHS.items()])
    for label, c in columns:
        print(f"package -> package calls, {label}:", ", ".join(sorted(set(sum(
            (f["packages"] for f in c["paths"].values()), [])))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", default=str(HERE.parents[1] / "examples" / "example-L24.chain.json"))
    parser.add_argument("--before", help="a checkout, measured in a process of its own")
    parser.add_argument("--after", help="a second checkout, measured the same way")
    parser.add_argument("--json", action="store_true", help="print this checkout's figures as JSON")
    args = parser.parse_args()
    chain, checkouts = str(Path(args.chain).resolve()), [c for c in (args.before, args.after) if c]
    if args.json:
        return print(json.dumps(measure(chain)))
    table([column(c, chain) for c in checkouts] if checkouts else [("this checkout", measure(chain))], chain)


if __name__ == "__main__":
    main()
